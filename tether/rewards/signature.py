"""Calling a user's reward function in the form it was written.

tether calls every reward as ``fn(sample) -> float``. Scorers written elsewhere take the response
text and the label instead, so the function's signature decides how it is called:

    def reward(sample): ...                              # the Sample (prompt, response_text, label, metadata, ...)
    def reward(response: str, label) -> float: ...      # any two positional parameters: response text, label
    def reward(prompt, response, label, metadata): ...  # parameters named as below, in any order
    def compute_score(data_source, solution_str, ground_truth, extra_info=None): ...   # verl's form

Recognised parameter names: sample; prompt; response, response_text, completion, solution_str;
label, ground_truth, answer, reference; metadata; extra_info (metadata["extra_info"] when the row has
one, else the metadata); data_source (metadata["data_source"]).

TRL's batched form is recognised by its plural parameters (prompts, completions, completion_ids):

    def reward(prompts, completions, completion_ids, **columns) -> list[float | None]: ...

called once per group with one entry per sample; ``columns`` holds the label (under data.label_key's
name) and every metadata field, as lists, and ``log_metric``; None means "not scored".
An ``async def`` reward is awaited: the rollout runs those of many samples concurrently.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Coroutine, cast

from tether.sample import Sample

_FIELDS: dict[str, Callable[[Sample], Any]] = {
    "sample": lambda s: s,
    "prompt": lambda s: s.prompt,
    **{name: (lambda s: s.response_text) for name in ("response", "response_text", "completion", "solution_str")},
    **{name: (lambda s: s.label) for name in ("label", "ground_truth", "answer", "reference")},
    "metadata": lambda s: s.metadata,
    # A verl row's own extra_info field (its other fields are the metadata of a row without one).
    "extra_info": lambda s: s.metadata.get("extra_info", s.metadata),
    "data_source": lambda s: s.metadata.get("data_source"),
}
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
BATCHED = ("prompts", "completions", "completion_ids")
"""Parameter names of TRL's reward functions, called once for a batch (here: a group)."""


def resolve(value: Any) -> Any:
    """The value of a reward call made outside an event loop (an async reward returns a coroutine)."""
    # An async reward's call returns a coroutine (asyncio.run takes nothing else).
    return asyncio.run(cast("Coroutine[Any, Any, Any]", value)) if inspect.isawaitable(value) else value


def is_async(fn: Callable) -> bool:
    """Whether calling the (adapted) reward returns an awaitable."""
    return getattr(fn, "is_async", False) or inspect.iscoroutinefunction(fn)


def adapt_reward(fn: Callable, spec: str, error: type[Exception]) -> Callable[[Sample], Any]:
    """``fn`` as a function of one Sample, chosen from its signature; ``error`` names the spec.

    The result returns what ``fn`` returns (a coroutine for an async ``fn``; ``is_async`` says which).
    """
    adapted = _adapt(fn, spec, error)
    if adapted is not fn:
        # A function attribute, read back by is_async; mypy does not type attributes set on functions.
        adapted.is_async = inspect.iscoroutinefunction(fn)  # type: ignore[attr-defined]
    return adapted


def _adapt(fn: Callable, spec: str, error: type[Exception]) -> Callable[[Sample], Any]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins and C functions have no signature: take them as fn(sample)
        return lambda s: fn(s)
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    named = [p.name for p in required]
    positional = [p for p in required if p.kind in _POSITIONAL]
    if len(positional) == len(required) == 1 and named[0] not in _FIELDS or named == ["sample"]:
        return fn  # already tether's form
    if required and all(name in _FIELDS for name in named):
        # Optional parameters with a known name are filled too (verl's extra_info=None).
        names = [p.name for p in params if p.name in _FIELDS and p.kind is not inspect.Parameter.POSITIONAL_ONLY]
        getters = {name: _FIELDS[name] for name in names}
        return lambda s: fn(**{name: get(s) for name, get in getters.items()})
    if len(positional) == len(required) == 2:
        return lambda s: fn(s.response_text, s.label)
    raise error(f"reward spec '{spec}': cannot tell how to call {getattr(fn, '__name__', fn)}{inspect.signature(fn)}; "
                "write fn(sample), fn(response, label), or name its parameters from "
                f"{sorted(_FIELDS)}")


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` is written in TRL's batched form (a parameter named prompts, completions or
    completion_ids)."""
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name in names for name in BATCHED)


def batched_reward(fn: Callable, label_key: str = "label") -> Callable[[list[Sample]], Any]:
    """A TRL-style batched reward as a function of a group's samples, returning its list of rewards
    (awaitable when ``fn`` is async). A conversational prompt (a list of messages) gets its completion
    as [{"role": "assistant", "content": text}], as TRL gives it; ``label_key``: the keyword the
    label is passed under (the dataset column's name)."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    column = label_key if label_key.isidentifier() else "label"

    def arguments(samples: list[Sample]) -> dict[str, Any]:
        chat = isinstance(samples[0].prompt, list)
        values: dict[str, Any] = {k: [s.metadata.get(k) for s in samples]
                                  for k in sorted({k for s in samples for k in s.metadata if isinstance(k, str)})}

        def log_metric(name: str, value: float) -> None:  # averaged over the rollout like Sample.metrics
            for s in samples:
                s.metrics[name] = float(value)

        values.update({column: [s.label for s in samples], "prompts": [s.prompt for s in samples],
                       "completions": [[{"role": "assistant", "content": s.response_text}] if chat else s.response_text
                                       for s in samples],
                       "completion_ids": [list(s.response_ids) for s in samples], "log_metric": log_metric,
                       "trainer_state": None})
        return values if takes_all else {k: v for k, v in values.items() if k in params}

    if inspect.iscoroutinefunction(fn):
        async def call_async(samples: list[Sample]) -> Any:
            return await fn(**arguments(samples))
        return call_async
    return lambda samples: fn(**arguments(samples))
