"""One episode of an environment, as a generate function: the loop every adapter shares.

    messages, tools = env.start(row)             # the prompt (and the tools the model may call)
    loop:
        message = policy's turn                    # exact tokens, trained on
        new, done = env.respond(message, last)     # tool results / observation; inserted, not trained on
        stop when done, at max_turns, or when the response budget is spent (``last``)
    reward = env.reward()                          # None: rollout.reward scores the sample

An adapter (tether/envs/trl.py, skyrl.py, ...) only says what start, respond and reward mean for
its library. Every call into the environment is made here, so that its failures are classified the
same way for all of them: an exception from the environment is an EnvironmentFailure (the sample
is retried from its prompt, then masked: tether/rollout/failures.py), and TETHER_INJECT_FAULTS's
"environment" share fails calls on purpose.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Protocol

from tether.envs.conversation import Conversation, ConversationAborted
from tether.errors import EnvironmentFailure, SampleFailure
from tether.rollout.generate_fn import GenerateContext
from tether.run.faults import inject_fault
from tether.sample import Sample

class Episode(Protocol):
    name: str
    """The environment, in errors."""

    async def start(self, sample: Sample) -> tuple[list[dict], list[dict] | None]:
        """The starting messages and the tools' schemas (None: no tools)."""

    async def respond(self, message: dict, last: bool) -> tuple[list[dict], bool]:
        """The environment's messages answering an assistant turn, and whether the episode is over.
        ``last``: no turn follows (max_turns, or the response budget is spent): an environment that
        scores each step still takes it; tools need not run."""

    async def reward(self) -> float | dict | None:
        """The episode's reward (None: rollout.reward scores the sample)."""

    async def close(self) -> None:
        ...


async def call_env(name: str, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call into an environment (sync functions in a worker thread, so the rollout's other requests go
    on); its exceptions become EnvironmentFailure naming the environment and the call."""
    if inject_fault("environment"):
        raise EnvironmentFailure(f"{name}.{what}: injected fault (TETHER_INJECT_FAULTS)")
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await asyncio.to_thread(fn, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result
    except SampleFailure:
        raise
    except Exception as err:
        raise EnvironmentFailure(f"{name}.{what} raised {type(err).__name__}: {err}") from err


async def run_episode(ctx: GenerateContext, sample: Sample, sampling_params: dict, episode: Episode, *,
                      max_turns: int | None, tool_parser: str | None = "hermes", chat_template: str | None = None,
                      on_start: Callable[[Conversation], None] | None = None,
                      turn_tokens: int | None = None) -> Sample:
    """Generate ``sample`` as one episode of ``episode``; its reward is set when the environment gives one.
    ``tool_parser`` None: turns are given to the environment as text (it reads its own actions);
    ``on_start``: gets the conversation once it exists (an adapter that edits turns); ``turn_tokens``:
    the most tokens one turn may generate."""
    try:
        messages, tools = await episode.start(sample)
        talk = Conversation(ctx, sample, sampling_params, tools=tools, tool_parser=tool_parser,
                            chat_template=chat_template, turn_tokens=turn_tokens)
        talk.start(messages)
        if on_start is not None:
            on_start(talk)
        while True:
            message = await talk.turn()
            last = talk.done or (max_turns is not None and talk.turns >= max_turns)
            new, finished = await episode.respond(message, last)
            if finished or last:
                break
            talk.add(new)
        talk.finish()
        reward = await episode.reward()
        if reward is not None:  # checked as any reward (a dict: rollout.reward_key picks the one trained on)
            sample.reward = reward  # type: ignore[assignment]
    except ConversationAborted:
        return sample  # cut short by the rollout: it is dropped or continued, as any aborted sample
    finally:
        try:
            await episode.close()
        except Exception:  # noqa: BLE001 - the episode is over; an environment that fails to close costs it nothing
            sample.metrics["env_close_errors"] = 1.0
    return sample


def env_name(configured: str | None, sample: Sample, row_field: str, config_field: str) -> str:
    """The environment a sample plays: the config's, else the one its row names (SkyRL's env_class, GEM's env_id)."""
    name = configured or (sample.metadata.get(row_field) if isinstance(sample.metadata, dict) else None)
    if not isinstance(name, str):
        raise ValueError(f"{sample.describe()}: no environment: set rollout.environment.{config_field}, or give the "
                         f"row a {row_field} field")
    return name


def episode_reward(rewards: list[float], how: str) -> float:
    """The sample's reward from its steps' rewards: their sum, or the last one (0 when no step was taken:
    the first turn spent the whole budget and the environment saw nothing)."""
    if not rewards:
        return 0.0
    return sum(rewards) if how == "sum" else rewards[-1]


def load_factory(spec: str, what: str) -> Callable[..., Any]:
    """A class or function named by a module:name / file.py:name spec (an environment's factory)."""
    from tether.importing import load_function

    return load_function(spec, what, ValueError)
