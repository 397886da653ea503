"""TRL's environment classes as tether rollouts (``rollout.environment: {type: trl, factory: env.py:MyEnv}``).

The class is the one written for TRL's ``GRPOTrainer(environment_factory=MyEnv)``, unchanged:

    class WordleEnv:
        def reset(self, **row) -> str | None:   # the dataset row; a returned string is appended to
            ...                                  # the last prompt message's content
        def guess(self, word: str) -> str:       # every other public method is a tool for the model:
            '''Guess a word.                       # its schema from the signature and the docstring

            Args:
                word: a five-letter word.
            '''
        def get_reward(self) -> float:           # optional: the episode's reward
            ...

Per sample: an instance is made, reset with the row (its prompt under data.prompt_key, its label
under data.label_key, and the row's other fields), the model is shown the tools in the chat template
and answers; each tool call is made on the instance and its result goes back as a ``tool`` message
(an exception in a tool goes back as ``{'error': ...}``, as TRL does: the model learns from it); the
episode ends at a turn without a tool call, at ``max_turns``, or when the response budget is spent.
``get_reward()`` scores the sample when the class has it; otherwise rollout.reward does.

Differences from TRL: one instance per sample, never pooled (state cannot leak between episodes);
sync methods run in a worker thread; a tool or reset that raises EnvironmentFailure / ToolFailure,
or an instance that cannot be made, is an infrastructure failure (retried, then masked) instead of
a message to the model.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Callable

from tether.envs.config import TrlEnvironmentConfig
from tether.envs.episode import call_env, load_factory, run_episode
from tether.errors import SampleFailure, ToolFailure
from tether.rollout.generate_fn import GenerateContext
from tether.run.faults import inject_fault
from tether.sample import Sample

NOT_TOOLS = ("reset", "get_reward")


def tool_methods(env: Any) -> dict[str, Callable]:
    """The environment's tools, as TRL finds them: the public functions of its class but reset and
    get_reward (properties and instance attributes are not tools), bound to the instance."""
    return {name: getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS}


def tool_schemas(tools: dict[str, Callable], where: str) -> list[dict]:
    """OpenAI function schemas from signatures and Google-style docstrings (transformers' get_json_schema,
    as TRL renders them)."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, fn in tools.items():
        try:
            schemas.append(get_json_schema(fn))
        except Exception as err:  # noqa: BLE001 - transformers raises its own DocstringParsingException
            raise ValueError(f"{where}: tool method {name}: {err} (a tool needs type hints and a docstring with "
                             "an Args: entry for each argument)") from None
    return schemas


@functools.cache
def _factory(spec: str) -> Callable[[], Any]:
    return load_factory(spec, "environment factory")


def factory_for(c: TrlEnvironmentConfig, sample: Sample) -> tuple[str, Callable[[], Any]]:
    """(its name, the factory) of the sample's environment: the one factory, or the row's pick of several."""
    if isinstance(c.factory, str):
        return c.factory, _factory(c.factory)
    name = sample.metadata.get("environment") if isinstance(sample.metadata, dict) else None
    if name not in c.factory:
        raise ValueError(f"{sample.describe()}: rollout.environment.factory names {sorted(c.factory)}; the row's "
                         f"'environment' field is {name!r}")
    return name, _factory(c.factory[name])


def row_of(sample: Sample, prompt_key: str, label_key: str) -> dict[str, Any]:
    """The dataset row as TRL hands it to reset: the prompt, the label and the row's other fields."""
    row = {k: v for k, v in sample.metadata.items() if k != "environment"} if isinstance(sample.metadata, dict) else {}
    row[prompt_key.split(".")[0]] = sample.prompt
    if sample.label is not None:
        row[label_key.split(".")[-1]] = sample.label
    return row


class TrlEpisode:
    def __init__(self, name: str, factory: Callable[[], Any], row: dict[str, Any]):
        self.name, self.factory, self.row = name, factory, row
        self.env: Any = None
        self.tools: dict[str, Callable] = {}
        self.calls = self.errors = 0

    async def start(self, sample: Sample) -> tuple[list[dict], list[dict] | None]:
        self.env = await call_env(self.name, "__init__", self.factory)
        observation = await call_env(self.name, "reset", self.env.reset, **self.row)
        prompt = sample.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if isinstance(observation, str):
            messages[-1]["content"] = (messages[-1].get("content") or "") + observation
        elif observation is not None:
            raise ValueError(f"{self.name}.reset returned {observation!r:.100}; expected a string or None")
        self.tools = tool_methods(self.env)
        return messages, tool_schemas(self.tools, self.name) or None

    async def respond(self, message: dict, last: bool) -> tuple[list[dict], bool]:
        calls = message.get("tool_calls") or []
        if not calls or last:  # as TRL: the calls of a turn past max_tool_calling_iterations are not made
            return [], True
        out = []
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            self.calls += 1
            out.append({"role": "tool", "name": name, "content": await self._call(name, arguments)})
        return out, False

    async def _call(self, name: str, arguments: Any) -> str:
        fn = self.tools.get(name)
        if inject_fault("tool"):
            raise ToolFailure(f"{self.name}.{name}: injected fault (TETHER_INJECT_FAULTS)")
        try:
            if fn is None:
                raise ValueError(f"Tool {name} not found.")
            if isinstance(arguments, str):  # not JSON: the model's own mistake, shown to it
                arguments = json.loads(arguments)
            result = await _run(fn, arguments)
        except SampleFailure:
            raise
        except Exception as err:  # noqa: BLE001 - TRL's way: the model sees the error and the episode goes on
            self.errors += 1
            return str({"error": str(err)})
        return result if isinstance(result, str) else str(result)

    async def reward(self) -> float | dict | None:
        if not hasattr(type(self.env), "get_reward"):
            return None
        return await call_env(self.name, "get_reward", self.env.get_reward)

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            await call_env(self.name, "close", close)


async def _run(fn: Callable, arguments: dict) -> Any:
    import asyncio

    if inspect.iscoroutinefunction(fn):
        return await fn(**arguments)
    return await asyncio.to_thread(fn, **arguments)


async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """The generate function of ``rollout.environment: {type: trl}``."""
    assert ctx.cfg is not None and isinstance(ctx.cfg.rollout.environment, TrlEnvironmentConfig)
    c, d = ctx.cfg.rollout.environment, ctx.cfg.data
    name, factory = factory_for(c, sample)
    episode = TrlEpisode(name, factory, row_of(sample, d.prompt_key, d.label_key))
    await run_episode(ctx, sample, sampling_params, episode, max_turns=c.max_turns, tool_parser=c.tool_parser, turn_tokens=c.max_turn_tokens,
                      chat_template=c.chat_template)
    sample.metrics.update(tool_calls=float(episode.calls), tool_errors=float(episode.errors))
    return sample


def check(c: TrlEnvironmentConfig) -> None:
    """Load every factory and check its class has reset and describable tools (before anything starts)."""
    specs = [c.factory] if isinstance(c.factory, str) else list(c.factory.values())
    for spec in specs:
        factory = _factory(spec)
        cls = factory if inspect.isclass(factory) else None
        if cls is not None:
            if not callable(getattr(cls, "reset", None)):
                raise ValueError(f"environment factory '{spec}': {cls.__name__} has no reset method")
            tools = {n: _unbound(f) for n, f in inspect.getmembers(cls, predicate=inspect.isfunction)
                     if not n.startswith("_") and n not in NOT_TOOLS}
            tool_schemas(tools, spec)


def _unbound(fn: Callable) -> Callable:
    """A method as its bound form would look (no self), to describe it without making an instance."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if inspect.isfunction(fn) and params and params[0].name == "self":
        @functools.wraps(fn)
        def described(*args: Any, **kwargs: Any) -> Any:
            raise TypeError("described only")
        described.__signature__ = sig.replace(parameters=params[1:])  # type: ignore[attr-defined]
        return described
    return fn
