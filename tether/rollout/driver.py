"""The rollout driver: groups generated concurrently, scored as they finish, kept when a filter passes them.

A group is the n samples of one prompt. The driver takes groups from a source in order, gives each a
start index (0, 1, 2, ...), and keeps the first ``need`` groups, in start order, that the filter
passes. Which groups are kept therefore depends only on each group's own outcome (its samples have
their own seeds), never on which finished first. ``keep_first_finished`` keeps the first ``need`` to
finish instead (slime's way): the groups that would make a rollout wait (a long tail) are cut short
and, with partial rollout, continued by the next rollout.

Two schedules:
- streaming (the default): every group is its own /generate request, at most
  ``max_concurrent_groups`` in flight. A group is scored the moment it finishes, while others still
  generate. When a dropped group leaves room, the next group starts. As soon as the first ``need``
  passing groups are known, everything started after them is aborted on the engines.
- waves (``deterministic: true``): ``over_sampling_groups`` groups at a time, cut into one request per
  engine, a wave finishing before the next starts. The engines then batch exactly the same requests
  on every run, so generation is bitwise repeatable (streaming batches groups as they happen to
  arrive, which moves log-probs by ~1e-6).
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator

import httpx

from tether.engine.sampling import SamplingParams
from tether.http_client import async_client, engine_headers, pool_limits
from tether.rollout.fleet import EngineFleet, split_groups
from tether.rollout.generate_fn import CustomGenerate, GenerateError, group_tokens
from tether.router import EngineLost
from tether.sample import Sample

Group = list[Sample]
ScoreFn = Callable[[Group], Awaitable[None]]
KeepFn = Callable[[Group], tuple[bool, str]]


@dataclass
class Started:
    start: int
    samples: Group
    kept: bool | None = None  # None until generated and scored
    reason: str = ""


@dataclass
class DriverResult:
    kept: list[Group]
    """The first ``need`` groups the filter passed, in start order (fewer when the source ran out)."""
    unfinished: list[Group]
    """Groups started after the last kept one and cut short by the abort (their partial responses)."""
    surplus: list[Group]
    """Groups that finished after the last kept one (not trained on)."""
    consumed: int
    """Groups of the source used up: through the last kept one (all started ones when it ran out)."""
    exhausted: bool
    """The source ran out before ``need`` groups passed."""
    started: int = 0
    """Groups taken from the source."""
    leftover: list[Group] = field(default_factory=list)
    """Unfinished and surplus groups not dropped by the filter, in start order (partial rollout keeps them)."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Schedule:
    need: int
    """Groups to keep."""
    over_sampling_groups: int
    """Groups started at first (and started-and-not-dropped at most, streaming); a wave's size (waves)."""
    max_concurrent_groups: int | None
    waves: bool
    keep_first_finished: bool = False
    """Keep the first ``need`` groups to finish and pass (streaming only), not the first in start order."""
    groups_per_request: int = 1
    """Groups started together share a request, up to this many (streaming; waves split by engine)."""


class GroupDriver:
    def __init__(self, fleet: EngineFleet, timeout_s: float, custom: CustomGenerate | None = None):
        self.fleet = fleet
        self.timeout_s = timeout_s
        self.custom = custom

    def run(self, groups: Iterator[Group], schedule: Schedule, params: SamplingParams, seed: int,
            score: ScoreFn, keep: KeepFn, what: str, evaluation: bool = False) -> DriverResult:
        return asyncio.run(self.arun(groups, schedule, params, seed, score, keep, what, evaluation))

    async def arun(self, groups: Iterator[Group], schedule: Schedule, params: SamplingParams, seed: int,
                   score: ScoreFn, keep: KeepFn, what: str, evaluation: bool = False) -> DriverResult:
        limits = pool_limits(max_connections=None, max_keepalive=64)
        async with async_client(self.timeout_s, limits=limits, headers=engine_headers()) as client:
            run = _Run(self.fleet, client, groups, schedule, params, seed, score, keep, what, self.custom, evaluation)
            start = time.perf_counter()
            result = await (run.waves() if schedule.waves else run.streaming())
            result.metrics["timing/generate_s"] = time.perf_counter() - start
            result.metrics["timing/reward_s"] = run.reward_s
            return result

    async def generate_group(self, client: httpx.AsyncClient, group: Group, params: SamplingParams, seed: int,
                             what: str, evaluation: bool = False) -> Group:
        """One group generated in place, as a run would generate it (for rollout functions); returns it
        (a generate function may change its size)."""
        run = _Run(self.fleet, client, iter(()), Schedule(1, 1, None, False), params, seed, None, None, what,
                   self.custom, evaluation)
        await run._generate(group, len(group), what)
        return group


class _Run:
    """One driver run: the started groups, in start order, and what became of each."""

    def __init__(self, fleet, client, groups, schedule: Schedule, params, seed, score, keep, what,
                 custom: CustomGenerate | None = None, evaluation: bool = False):
        self.fleet, self.client, self.source, self.s = fleet, client, groups, schedule
        self.params, self.seed, self.score, self.keep, self.what = params, seed, score, keep, what
        self.timeout_s = fleet.timeout_s
        self.started: list[Started] = []
        self.decided: list[Started] = []  # in the order they were kept or dropped
        self.cut = False  # set once the kept groups are known: later aborts are ours
        self.exhausted = False
        self.tag = uuid.uuid4().hex[:8]
        self.custom, self.evaluation = custom, evaluation
        self.reward_s = 0.0
        self.aborted_samples = 0

    def _next(self) -> Started | None:
        group = next(self.source, None)
        if group is None:
            self.exhausted = True
            return None
        item = Started(len(self.started), group)
        for s in group:
            s.group_index = item.start
        self.started.append(item)
        return item

    def _seeds(self, samples: list[Sample], n: int) -> list[int]:
        # As in a single batch of all groups: sample j of the k-th group started has seed position k*n + j.
        return [self.seed * 1_000_003 + s.group_index * n + s.sample_index for s in samples]

    def _rids(self, group: Group) -> list[str]:
        return [f"{self.tag}-{s.group_index}-{s.sample_index}" for s in group]

    async def _judge(self, item: Started) -> None:
        if any(s.status == "aborted" for s in item.samples):
            if not self.cut:  # the engine gave up on it (its request timeout): a dropped group
                item.kept, item.reason = False, "aborted_by_engine"
                self.decided.append(item)
            return  # cut short by our abort: neither kept nor dropped, it is unfinished
        start = time.perf_counter()
        await asyncio.wait_for(self.score(item.samples), self.timeout_s)
        self.reward_s += time.perf_counter() - start
        item.kept, item.reason = self.keep(item.samples)
        self.decided.append(item)

    async def _generate(self, samples: Group, n: int, what: str) -> None:
        """Generate these samples (whole groups) in place: one request, or a group's generate function."""
        seeds, rids = self._seeds(samples, n), self._rids(samples)
        spec = self.custom.spec_for(samples[0]) if self.custom else None
        if spec is None:
            return await self.fleet.generate(self.client, samples, self.params, seeds, rids, what)
        router = self.fleet.router
        while True:
            # A group whose engine is lost starts again, from what it was, on another engine.
            before = copy.deepcopy(samples) if self.fleet.reissue else None
            url = None
            try:
                async with router.lease_async(group_tokens(samples, self.params)) as url:
                    samples[:] = await self.custom.generate_group(spec, list(samples), self.params, url, self.client,
                                                                  seeds, rids, lambda: self.cut, self.timeout_s,
                                                                  self.evaluation)
                return
            except (EngineLost, GenerateError) as err:
                cause = err.__cause__
                connection = isinstance(cause, httpx.TransportError) and not isinstance(cause, httpx.TimeoutException)
                if before is None or not (isinstance(err, EngineLost) or connection):
                    raise
                router.mark_lost(url, f"{type(cause).__name__}: {cause}" if connection else err.reason)
                samples[:] = before
                self.fleet.reissued_samples += len(samples)

    async def _groups(self, items: list[Started]) -> None:
        """Generate these groups in one request (a generate function: each its own way), then judge them."""
        if len(items) == 1 or self.custom is not None:
            await asyncio.gather(*(self._generate(item.samples, len(item.samples), f"{self.what}, group {item.start}")
                                   for item in items))
        else:
            await self._generate([s for item in items for s in item.samples], len(items[0].samples),
                                 f"{self.what}, groups {items[0].start}..{items[-1].start}")
        await asyncio.gather(*(self._judge(item) for item in items))

    def _cutoff(self) -> list[Started] | None:
        """The ``need`` kept groups, in start order, once they are known."""
        if self.s.keep_first_finished:
            kept = [item for item in self.decided if item.kept][: self.s.need]
            return sorted(kept, key=lambda item: item.start) if len(kept) == self.s.need else None
        kept = []
        for item in self.started:  # the first ``need`` kept, once every group before the last is decided
            if item.kept is None:
                return None
            if item.kept:
                kept.append(item)
            if len(kept) == self.s.need:
                return kept
        return None

    def _live(self) -> int:
        return sum(item.kept is not False for item in self.started)

    def _start(self, tasks: dict[asyncio.Task, list[Started]]) -> None:
        """Start groups while there is room, in requests of up to groups_per_request groups."""
        cap = self.s.max_concurrent_groups or self.s.over_sampling_groups
        in_flight = sum(len(items) for items in tasks.values())
        batch: list[Started] = []
        while not self.exhausted and in_flight + len(batch) < cap and self._live() < self.s.over_sampling_groups:
            item = self._next()
            if item is not None:
                batch.append(item)
            if batch and (len(batch) == self.s.groups_per_request or item is None):
                tasks[asyncio.create_task(self._groups(batch))] = batch
                in_flight, batch = in_flight + len(batch), []
        if batch:
            tasks[asyncio.create_task(self._groups(batch))] = batch

    async def streaming(self) -> DriverResult:
        tasks: dict[asyncio.Task, list[Started]] = {}
        try:
            cutoff = None
            while cutoff is None:
                self._start(tasks)
                if not tasks:
                    break
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    tasks.pop(task)
                    task.result()  # a failed generation or reward fails the rollout here
                cutoff = self._cutoff()
            self.cut = True
            await self._abort([item for items in tasks.values() for item in items])
            await asyncio.gather(*tasks)
        except BaseException:
            self.cut = True  # generate functions start no new turn
            await self._abort_quietly([item for items in tasks.values() for item in items])
            raise
        return self._result(cutoff)

    async def waves(self) -> DriverResult:
        cutoff = None
        while cutoff is None and not self.exhausted:
            wave = [item for item in (self._next() for _ in range(self.s.over_sampling_groups)) if item is not None]
            if not wave:
                break
            n = len(wave[0].samples)
            if self.custom is not None:  # generate functions work a group at a time
                await asyncio.gather(*(self._generate(item.samples, n, f"{self.what}, group {item.start}")
                                       for item in wave))
            else:
                samples = [s for item in wave for s in item.samples]
                parts = [p for p in split_groups(len(samples), n, self.fleet.num_engines) if p]
                await asyncio.gather(*(self._generate(
                    [samples[i] for i in part], n, f"{self.what}, groups {wave[0].start}..{wave[-1].start}")
                    for part in parts))
            await asyncio.gather(*(self._judge(item) for item in wave))
            cutoff = self._cutoff()
        return self._result(cutoff)

    async def _abort(self, items: list[Started]) -> None:
        if items:
            rids = [rid for item in items for rid in self._rids(item.samples)]
            await self.fleet.abort(self.client, rids)
            self.aborted_samples += len(rids)

    async def _abort_quietly(self, items: list[Started]) -> None:
        # Failing already: stop the engines' work on the other groups, without hiding the first error.
        try:
            await asyncio.wait_for(self._abort(items), 10)
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass

    def _result(self, chosen: list[Started] | None) -> DriverResult:
        exhausted = chosen is None
        if exhausted:
            chosen = [i for i in self.started if i.kept]
        chosen_ids = {i.start for i in chosen}
        if self.s.keep_first_finished:  # every started group is used up: kept, dropped or left over
            judged = [i for i in self.started if i.start in chosen_ids or i.kept is False]
            consumed = len(self.started)
        else:  # start order: up to the last kept group; what started after it is left over
            last = chosen[-1].start if chosen and not exhausted else len(self.started) - 1
            judged = self.started[:last + 1]
            consumed = len(self.started) if exhausted or self.s.waves else last + 1
        judged_ids = {i.start for i in judged}
        after = [i for i in self.started if i.start not in judged_ids]
        reasons = Counter(i.reason or "filtered" for i in judged if i.kept is False)
        metrics = {"rollout/groups_started": float(len(self.started)), "rollout/groups_kept": float(len(chosen)),
                   "rollout/groups_dropped": float(sum(reasons.values())),
                   "rollout/groups_aborted": float(sum(i.kept is None for i in after)),
                   "rollout/groups_surplus": float(sum(i.kept is not None for i in after)),
                   "rollout/samples_aborted": float(self.aborted_samples),
                   **{f"rollout/groups_dropped/{r}": float(c) for r, c in reasons.items()}}
        return DriverResult(kept=[i.samples for i in chosen], unfinished=[i.samples for i in after if i.kept is None],
                            surplus=[i.samples for i in after if i.kept is not None], consumed=consumed,
                            exhausted=exhausted, started=len(self.started), metrics=metrics,
                            leftover=[i.samples for i in after if i.kept is not False])
