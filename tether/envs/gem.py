"""GEM's gym-style environments as tether rollouts (``rollout.environment: {type: gem, env_id: game:Sudoku-v0-easy}``).

GEM (``gem-llm``) environments are gym's shape for text: ``reset(seed) -> (observation, info)`` and
``step(action) -> (observation, reward, terminated, truncated, info)``, made by ``gem.make(env_id)``;
observations and actions are strings (a game's instructions, its answer to a move; the model's text).

Per sample: the environment is made and reset with a seed shared by the samples of a prompt (a
group plays one game, so its answers are compared on the same game; a row's ``seed`` field wins); its
first observation is the user message (after the row's prompt, when the row has one), followed by
``info["suffix"]`` when the environment gives one (GEM's games put "Enter your next guess." there).
Each assistant turn's text is a step; the step's observation is the next user message (inserted,
not trained on), until the environment terminates or truncates the episode, ``max_turns`` turns were
taken, or the response budget is spent. The reward is the steps' rewards summed (or the last one).
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

from tether.envs.config import GemEnvironmentConfig
from tether.envs.episode import call_env, env_name, episode_reward, run_episode
from tether.rollout.generate_fn import GenerateContext
from tether.sample import Sample


@functools.cache
def _gem() -> Any:
    try:
        import gem
    except ImportError as err:
        raise ImportError("rollout.environment.type: gem needs the gem-llm package: pip install gem-llm "
                          "(--no-deps beside tether: it pins an older reasoning-gym)") from err
    return gem


def env_id_of(c: GemEnvironmentConfig, sample: Sample) -> str:
    return env_name(c.env_id, sample, "env_id", "env_id")


class GemEpisode:
    def __init__(self, c: GemEnvironmentConfig, sample: Sample, seed: int):
        self.c, self.name, self.seed = c, env_id_of(c, sample), seed
        self.env: Any = None
        self.rewards: list[float] = []

    def _text(self, observation: Any, info: Any) -> str:
        text = str(observation)
        suffix = info.get("suffix") if isinstance(info, dict) and self.c.append_suffix else None
        return f"{text}\n{suffix}" if suffix else text

    async def start(self, sample: Sample) -> tuple[list[dict], list[dict] | None]:
        self.env = await call_env(self.name, "make", _gem().make, self.name, **self.c.env_kwargs)
        observation, info = await call_env(self.name, "reset", self.env.reset, seed=self.seed)
        text = self._text(observation, info)
        prompt = sample.prompt
        if isinstance(prompt, list):
            messages = [dict(m) for m in prompt]
            messages[-1]["content"] = (messages[-1].get("content") or "") + "\n" + text
        else:
            messages = [{"role": "user", "content": f"{prompt}\n{text}" if prompt else text}]
        return messages, None

    async def respond(self, message: dict, last: bool) -> tuple[list[dict], bool]:
        observation, reward, terminated, truncated, info = await call_env(
            self.name, "step", self.env.step, message.get("content") or "")
        self.rewards.append(float(reward or 0.0))
        done = bool(terminated or truncated)
        return ([] if done else [{"role": "user", "content": self._text(observation, info)}]), done

    async def reward(self) -> float | None:
        return episode_reward(self.rewards, self.c.reward)

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            await call_env(self.name, "close", close)


def seed_of(cfg_seed: int, sample: Sample) -> int:
    """The game's seed: the row's ``seed`` field, else one per prompt (every sample of a group plays it)."""
    given = sample.metadata.get("seed") if isinstance(sample.metadata, dict) else None
    return int(given) if isinstance(given, int) else zlib.crc32(f"{cfg_seed}:{sample.prompt_index}".encode())


async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """The generate function of ``rollout.environment: {type: gem}``."""
    assert ctx.cfg is not None and isinstance(ctx.cfg.rollout.environment, GemEnvironmentConfig)
    c = ctx.cfg.rollout.environment
    episode = GemEpisode(c, sample, seed_of(ctx.cfg.seed, sample))
    await run_episode(ctx, sample, sampling_params, episode, max_turns=c.max_turns, tool_parser=None,
                      chat_template=c.chat_template, turn_tokens=c.max_turn_tokens)
    sample.metrics["env_steps"] = float(len(episode.rewards))
    return sample


def check(c: GemEnvironmentConfig) -> None:
    """The package is there and the environment is registered (before anything starts)."""
    _gem()
    from gem.envs.registration import ENV_REGISTRY as known

    if c.env_id is not None and c.env_id not in known:
        close = sorted(k for k in known if k.split("-")[0] == c.env_id.split("-")[0])[:6]
        raise ValueError(f"rollout.environment.env_id '{c.env_id}' is not a registered GEM environment"
                         + (f"; did you mean one of {close}?" if close else ""))
