"""skyrl-gym's text environments as tether rollouts (``rollout.environment: {type: skyrl_gym, env_class: gsm8k}``).

skyrl-gym (pip install skyrl-gym) is SkyRL's library of text environments: ``BaseTextEnv`` with
``init(prompt messages) -> (messages, info)`` and ``step(action text) -> {observations, reward, done,
metadata, postprocessed_action}``, made by ``skyrl_gym.make(env_class, env_config=..., extras=row)``.
A SkyRL dataset row loads as it is: its ``prompt`` (chat messages), and its other fields
(``env_class``, ``reward_spec``, ``extra_info``, ...) as the sample's metadata, which is the
environment's ``extras`` (with ``max_turns`` added unless the row has it).

Per sample: the environment is made and initialised with the prompt; each assistant turn's text is
a step; the step's observations are inserted (not trained on) and the model goes on, until the
environment says done, ``max_turns`` turns were taken or the response budget is spent. The reward is
the steps' rewards summed (or the last one: ``reward: last``); the environment's ``get_metrics()``
are recorded as per-sample metrics (``rollout/sample/<name>_mean``).

A ``postprocessed_action`` that is a prefix of the turn's text (an environment cutting a turn after
its tool call) cuts the turn's tokens to the longest prefix spelling no more than it, so what the
trainer sees is still a prefix of what the engine sampled; one that rewrites the text otherwise is
left aside (counted in ``rollout/sample/actions_rewritten_mean``), as rewriting tokens the policy
never sampled would train on them.
"""

from __future__ import annotations

import functools
from typing import Any

from tether.envs.config import SkyrlEnvironmentConfig
from tether.envs.episode import call_env, env_name, episode_reward, run_episode
from tether.rollout.generate_fn import GenerateContext
from tether.sample import Sample


@functools.cache
def _skyrl() -> Any:
    try:
        import skyrl_gym
    except ImportError as err:
        raise ImportError("rollout.environment.type: skyrl_gym needs the skyrl-gym package: pip install skyrl-gym") \
            from err
    return skyrl_gym


def env_class_of(c: SkyrlEnvironmentConfig, sample: Sample) -> str:
    return env_name(c.env_class, sample, "env_class", "env_class")


def extras_of(c: SkyrlEnvironmentConfig, sample: Sample) -> dict[str, Any]:
    """The row's fields as the environment's extras: its metadata, its label as reward_spec.ground_truth
    when the row has no reward_spec of its own, and max_turns."""
    extras = dict(sample.metadata) if isinstance(sample.metadata, dict) else {}
    if "reward_spec" not in extras and sample.label is not None:
        extras["reward_spec"] = {"method": "rule", "ground_truth": sample.label}
    extras.setdefault("max_turns", c.max_turns)
    return extras


class SkyrlEpisode:
    def __init__(self, c: SkyrlEnvironmentConfig, sample: Sample):
        self.c, self.name = c, env_class_of(c, sample)
        self.extras = extras_of(c, sample)
        self.env: Any = None
        self.rewards: list[float] = []
        self.rewritten = 0
        self.talk: Any = None  # the conversation, for cutting a turn to a postprocessed action

    async def start(self, sample: Sample) -> tuple[list[dict], list[dict] | None]:
        self.env = await call_env(self.name, "make", _skyrl().make, self.name, env_config=dict(self.c.env_config),
                                  extras=self.extras)
        prompt = sample.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        first, _info = await call_env(self.name, "init", self.env.init, messages)
        return [dict(m) for m in first], None

    async def respond(self, message: dict, last: bool) -> tuple[list[dict], bool]:
        out = await call_env(self.name, "step", self.env.step, message.get("content") or "")
        self.rewards.append(float(out.get("reward") or 0.0))
        action = out.get("postprocessed_action")
        if action is not None and self.talk is not None and not self.talk.cut_turn_to(action):
            self.rewritten += 1
        return [dict(m) for m in out.get("observations") or []], bool(out.get("done"))

    async def reward(self) -> float | None:
        return episode_reward(self.rewards, self.c.reward)

    def metrics(self) -> dict[str, float]:
        found = self.env.get_metrics() if self.env is not None else {}
        out = {k: float(v) for k, v in (found or {}).items() if isinstance(v, (int, float))}
        out["actions_rewritten"] = float(self.rewritten)
        return out

    async def close(self) -> None:
        if self.env is not None:
            await call_env(self.name, "close", self.env.close)


async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """The generate function of ``rollout.environment: {type: skyrl_gym}``."""
    assert ctx.cfg is not None and isinstance(ctx.cfg.rollout.environment, SkyrlEnvironmentConfig)
    c = ctx.cfg.rollout.environment
    episode = SkyrlEpisode(c, sample)
    await run_episode(ctx, sample, sampling_params, episode, max_turns=c.max_turns, tool_parser=None, turn_tokens=c.max_turn_tokens,
                      chat_template=c.chat_template, on_start=lambda talk: setattr(episode, "talk", talk))
    sample.metrics.update(episode.metrics())
    return sample


def check(c: SkyrlEnvironmentConfig) -> None:
    """The package is there and the environment is registered (before anything starts)."""
    registry = getattr(_skyrl(), "registry", {})
    if c.env_class is not None and c.env_class not in registry:
        raise ValueError(f"rollout.environment.env_class '{c.env_class}' is not a registered skyrl-gym environment; "
                         f"registered: {sorted(registry)}")
