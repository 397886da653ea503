"""An OpenEnv environment server written as OpenEnv's users write one (openenv-core's Environment and
create_app), run by the OpenEnv tests in openenv-core's own Python environment:

    python -m uvicorn openenv_guess_server:app --port 8000
"""

import time
import uuid

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    text: str = ""


class GuessEnv(Environment):
    """Guess a number from 1 to 9 (the seed picks it); the answer says higher or lower."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.target = 5

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = 1 + (seed or 0) % 9
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return GuessObservation(text="1-9?", done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        if action.guess == 99:  # the tests' slow path: an environment that does not answer in time
            time.sleep(3)
        self._state.step_count += 1
        right = action.guess == self.target
        hint = "yes" if right else ("up" if action.guess < self.target else "down")
        return GuessObservation(text=hint, done=right, reward=1.0 if right else 0.0)

    @property
    def state(self):
        return self._state


app = create_app(GuessEnv, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
