"""Rollout functions: the code that produces one rollout's groups (slime's ``--rollout-function-path``).

    async def rollout(ctx, rollout_id, data_source, evaluation=False) -> list[list[Sample]] | RolloutOutput:
        groups = data_source.get_samples(ctx.cfg.rollout.prompts_per_rollout)
        await asyncio.gather(*(ctx.generate_group(g) for g in groups))     # built-in path or generate fn
        await asyncio.gather(*(ctx.score_group(g) for g in groups))        # the configured reward
        return RolloutOutput(groups, {"my/metric": 1.0})

``rollout.custom_rollout_fn`` names it; without one, ``builtin_rollout`` (tether/rollout/builtin.py)
runs, written against this same interface. A function may be sync: it then runs in a worker thread
and waits on ctx's coroutines with ``ctx.run(...)``. ``evaluation`` is passed only when the function
takes it; in an eval, ``data_source`` holds that eval set's groups and ``ctx.sampling_params`` and
``ctx.score_group`` are the set's.

What comes back is checked (groups of Samples, aligned, one size for training) and every group whose
rewards are not all set is scored with the configured reward; then the rollout goes on as the
built-in one does (post-processing, metrics, dumps, the train batch).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine

import httpx

from tether.config import TetherConfig
from tether.engine.sampling import SamplingParams
from tether.http.client import async_client, engine_headers
from tether.importing import load_function
from tether.rollout.buffer import PartialBuffer
from tether.rollout.data_source import DataSource
from tether.rollout.fleet import sampling_payload
from tether.rollout.generate_fn import GenerateError, _where, takes_evaluation
from tether.sample import Sample, SampleError

FIELD = "rollout.custom_rollout_fn"
Group = list[Sample]


class RolloutFnLoadError(ValueError):
    """``rollout.custom_rollout_fn`` cannot be loaded."""


class RolloutFnError(RuntimeError):
    """A rollout function raised, or returned something that cannot be trained on."""


@dataclass
class RolloutOutput:
    """A rollout function's result: its groups, and metrics to log with the rollout's."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    """Texts shown as run warnings (the built-in rollout's data-exhausted notice, say)."""


class RolloutDataSource:
    """The training prompts, as a rollout function draws them: groups of n samples each.

    ``get_samples`` consumes; ``add_samples`` hands groups back (unfinished ones, say) to be given
    first by the next ``get_samples``, and they are saved with checkpoints. The position is saved too:
    a resumed run draws what the uninterrupted one would have.
    """

    def __init__(self, data: DataSource, buffer: PartialBuffer, rollout_id: int):
        self.data, self.buffer, self.rollout_id = data, buffer, rollout_id
        self.given = 0  # groups handed out this rollout: their group_index (and so their seeds)

    @property
    def epoch(self) -> int:
        return self.data.epoch

    def get_samples(self, num_groups: int) -> list[Group]:
        """The next ``num_groups`` groups: handed-back ones first, then fresh prompts (into the next
        epoch when this one runs out)."""
        groups = self.buffer.take()
        self.buffer.put(groups[num_groups:])
        groups = groups[:num_groups]
        while len(groups) < num_groups:
            fresh = list(itertools.islice(self.data.peek_groups(), num_groups - len(groups)))
            if not fresh:
                raise ValueError(f"the data source has no prompts left to give ({len(self.data.rows)} rows)")
            self.data.advance(len(fresh))
            groups += fresh
        return [self._tag(g) for g in groups]

    def add_samples(self, groups: list[Group]) -> None:
        """Hand groups back: the next rollout's ``get_samples`` gives them first, as they are."""
        self.buffer.put(groups)

    def _tag(self, group: Group) -> Group:
        for s in group:
            s.rollout_id, s.group_index = self.rollout_id, self.given
        self.given += 1
        return group


class EvalDataSource:
    """One eval set's groups, for a rollout function called with ``evaluation=True``."""

    def __init__(self, name: str, groups: list[Group], rollout_id: int):
        self.name, self.groups, self.rollout_id = name, groups, rollout_id
        for group in groups:
            for s in group:
                s.rollout_id = rollout_id
        self._next = 0

    def get_samples(self, num_groups: int | None = None) -> list[Group]:
        """The next ``num_groups`` groups of the set (all that are left by default; fewer at its end)."""
        end = len(self.groups) if num_groups is None else self._next + num_groups
        groups, self._next = self.groups[self._next:end], min(end, len(self.groups))
        return groups

    def __len__(self) -> int:
        return len(self.groups)


class RolloutContext:
    """What a rollout function gets besides the rollout id and the data source.

    For your code: ``cfg``, ``tokenizer``, ``rollout_id``, ``evaluation``, ``urls`` (the engines),
    ``client`` (an ``httpx.AsyncClient``), ``sampling_params`` (the SGLang dict; the eval set's in an
    eval), and ``generate_group``, ``score_group``, ``run``. The rest (``driver``, ``params``, ``seed``,
    ``schedule``, ``keep``, ``buffer``) is what the built-in rollout uses.
    """

    def __init__(self, *, cfg: TetherConfig, tokenizer, rollout_id: int, evaluation: bool, driver, params: SamplingParams,
                 seed: int, score: Callable[[Group], Awaitable[None]], schedule=None, keep=None, buffer=None,
                 what: str = ""):
        self.cfg, self.tokenizer, self.rollout_id, self.evaluation = cfg, tokenizer, rollout_id, evaluation
        self.args = cfg.args  # the config's args: the function's own settings
        self.driver, self.params, self.seed, self.schedule, self.keep, self.buffer = driver, params, seed, schedule, keep, buffer
        self.urls: list[str] = [w.url for w in driver.fleet.router.workers]
        # Without a seed: your own requests choose theirs (generate_group seeds each sample itself).
        self.sampling_params: dict = {k: v for k, v in sampling_payload(params, seed).items() if k != "sampling_seed"}
        self.what = what or f"rollout {rollout_id}"
        self._score = score
        self.client: httpx.AsyncClient | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def generate_group(self, group: Group) -> Group:
        """Generate a group in place, as the built-in rollout would (one request, or the configured generate
        function, which may change the group's size); seeds follow the samples' group and sample index."""
        group[:] = await self.driver.generate_group(self.client, group, self.params, self.seed,
                                                    f"{self.what}, group {group[0].group_index}", self.evaluation)
        return group

    async def score_group(self, group: Group) -> None:
        """The configured reward (with overlong shaping in training; the eval set's reward in an eval)."""
        await self._score(group)

    def run(self, awaitable: Coroutine[Any, Any, Any]) -> Any:
        """From a sync rollout function (which runs in a worker thread): wait for one of ctx's coroutines."""
        if self.loop is None:
            raise RuntimeError("ctx.run is for sync rollout functions, while the rollout runs")
        return asyncio.run_coroutine_threadsafe(awaitable, self.loop).result()


def load_rollout_fn(spec: str) -> Callable:
    try:
        return load_function(spec, "rollout function", RolloutFnLoadError)
    except RolloutFnLoadError as err:
        raise RolloutFnLoadError(f"{FIELD}: {err}") from None


async def call_rollout_fn(fn: Callable, spec: str, ctx: RolloutContext, data_source, evaluation: bool,
                          user_fn: bool = True) -> RolloutOutput:
    """Call ``fn`` (sync or async) with an HTTP client in ``ctx``; check what it returns and score the
    groups whose rewards it left unset. A user function's exception is wrapped to name it; tether's own
    rollout's (``user_fn`` False) pass as they are."""
    kwargs = {"evaluation": evaluation} if takes_evaluation(fn) else {}
    async with async_client(ctx.driver.timeout_s, headers=engine_headers()) as client:
        ctx.client, ctx.loop = client, asyncio.get_running_loop()
        try:
            if inspect.iscoroutinefunction(fn):
                result = await fn(ctx, ctx.rollout_id, data_source, **kwargs)
            else:
                result = await asyncio.to_thread(fn, ctx, ctx.rollout_id, data_source, **kwargs)
                if inspect.isawaitable(result):
                    result = await result
        except (GenerateError, RolloutFnError):
            raise
        except Exception as err:
            if not user_fn:  # tether's own rollout: its errors say what failed already
                raise
            raise RolloutFnError(f"{FIELD} '{spec}' raised {type(err).__name__}: {err}{_where(err)} "
                                 f"({ctx.what})") from err
        out = _checked(result, spec, ctx.what)
        await asyncio.gather(*(ctx.score_group(g) for g in out.groups if any(s.reward is None for s in g)))
    return out


def _checked(result, spec: str, what: str) -> RolloutOutput:
    out = result if isinstance(result, RolloutOutput) else RolloutOutput(result)
    groups = out.groups
    if not isinstance(groups, list) or not groups or not all(
            isinstance(g, list) and g and all(isinstance(s, Sample) for s in g) for g in groups):
        raise RolloutFnError(f"{FIELD} '{spec}' returned {result!r:.200} for {what}; expected a non-empty list of "
                             "groups (non-empty lists of Samples) or a RolloutOutput")
    for s in (s for g in groups for s in g):
        if s.status == "pending":
            raise RolloutFnError(f"{FIELD} '{spec}' returned a sample that was never generated ({s.describe()})")
        try:
            s.check_aligned()
        except SampleError as err:
            raise RolloutFnError(f"{FIELD} '{spec}' returned a sample that cannot be trained on: {err}") from None
    if not all(isinstance(v, (int, float)) for v in out.metrics.values()):
        raise RolloutFnError(f"{FIELD} '{spec}': metrics must be numbers, got {out.metrics!r:.200}")
    return out
