"""Environments written for other libraries, as their users write them (loaded by the environment tests)."""

from __future__ import annotations

RESETS: list[dict] = []


class CounterEnv:
    """A TRL environment class (GRPOTrainer's environment_factory shape)."""

    def reset(self, **row) -> str | None:
        RESETS.append(row)
        self.total = int(row["start"])
        return f" Start at {self.total}."

    def add(self, n: int) -> str:
        """Add to the counter.

        Args:
            n: how much to add.
        """
        if n > 90:
            raise ValueError("too much")
        self.total += n
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)

    @property
    def doubled(self) -> int:  # a property: never a tool
        return 2 * self.total

    def _helper(self) -> None:  # private: never a tool
        pass


class BrokenEnv(CounterEnv):
    """Its server refuses each sample's first connection: reset raises (an infrastructure failure, retried)."""

    def reset(self, **row) -> str | None:
        from tether.run.faults import CURRENT_SAMPLE

        if CURRENT_SAMPLE.get().attempt == 1:
            raise ConnectionError("environment server refused the connection")
        return super().reset(**row)


class NoDocstringEnv:
    def reset(self, **row):
        return None

    def act(self, x):
        return x


def every_turn_adds(text: str) -> tuple[str, list[dict]]:
    """A tool parser for a model that cannot write tool calls yet: each turn calls add(len(text))."""
    return text, [{"name": "add", "arguments": {"n": len(text)}}]


def turn_adds_too_much(text: str) -> tuple[str, list[dict]]:
    return text, [{"name": "add", "arguments": {"n": 99}}, {"name": "missing", "arguments": {}}]


def make_skyrl_echo_env():
    """A skyrl-gym BaseTextEnv, registered with skyrl_gym.register as SkyRL users add theirs."""
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

    class EchoEnv(BaseTextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__()
            extras = extras or {}
            self.max_turns = int(extras.get("max_turns", 1))
            self.target = str(extras["reward_spec"]["ground_truth"])
            self.seen: list[str] = []

        def step(self, action: str) -> BaseTextEnvStepOutput:
            self.turns += 1
            self.seen.append(action)
            done = self.turns >= self.max_turns
            observation = [] if done else [{"role": "user", "content": f"turn {self.turns} seen, go on"}]
            return BaseTextEnvStepOutput(observations=observation, reward=0.5 if len(action) else 0.0, done=done,
                                         metadata={})

        def get_metrics(self):
            return {"echo_turns": self.turns}

    return EchoEnv


def guess_of(text: str) -> dict:
    """The OpenEnv guess server's action from a turn's text: its first digit (0 when it has none)."""
    digits = [c for c in text if c.isdigit()]
    return {"guess": int(digits[0]) if digits else 0}


def slow_guess(text: str) -> dict:
    return {"guess": 99}


def make_gem_counting_env():
    """A GEM Env (gem.core.Env), registered with gem.register as GEM users add theirs: three moves, a
    quarter point each for a non-empty one."""
    from gem.core import Env

    class CountingEnv(Env):
        def reset(self, seed=None):
            super().reset(seed)
            self.moves, self.seed_seen = 0, seed
            return f"seed {seed % 100} go", {"suffix": "move?"}

        def step(self, action):
            self.moves += 1
            done = self.moves >= 3
            return f"got {len(action)}", 0.25 if action else 0.0, done, False, {"suffix": "move?"}

    return CountingEnv
