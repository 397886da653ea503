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
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import httpx

from tether.engine.sampling import SamplingParams
from tether.http.client import async_client, engine_headers, pool_limits
from tether.rollout.failures import FailureLog, FailurePolicy
from tether.rollout.fleet import EngineFleet, split_groups
from tether.rollout.generate_fn import CustomGenerate
from tether.rollout.group_runner import Group, GroupRunner, KeepFn, ScoreFn
from tether.rollout.watchdog import watched
from tether.sample import Sample


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
    def __init__(self, fleet: EngineFleet, timeout_s: float, custom: CustomGenerate | None = None,
                 policy: FailurePolicy | None = None):
        """``policy``: retries, masking and budgets of failed samples (rollout.failures)."""
        self.fleet = fleet
        self.timeout_s = timeout_s
        self.custom = custom
        self.policy = policy or (custom.policy if custom is not None else FailurePolicy())
        self.failures = FailureLog()  # of every run since the last take_failures()

    def run(self, groups: Iterator[Group], schedule: Schedule, params: SamplingParams, seed: int,
            score: ScoreFn, keep: KeepFn, what: str, evaluation: bool = False) -> DriverResult:
        return asyncio.run(self.arun(groups, schedule, params, seed, score, keep, what, evaluation))

    async def arun(self, groups: Iterator[Group], schedule: Schedule, params: SamplingParams, seed: int,
                   score: ScoreFn, keep: KeepFn, what: str, evaluation: bool = False) -> DriverResult:
        limits = pool_limits(max_connections=None, max_keepalive=64)
        async with async_client(self.timeout_s, limits=limits, headers=engine_headers()) as client:
            run = _Run(self.fleet, client, groups, schedule, params, seed, score, keep, what, self.custom, evaluation,
                       self.policy)
            start = time.perf_counter()
            try:
                result = await watched(run.waves() if schedule.waves else run.streaming(), run.runner.watchdog)
            finally:
                self.failures.merge(run.runner.failures)
            result.metrics["timing/generate_s"] = time.perf_counter() - start
            result.metrics["timing/reward_s"] = run.runner.reward_s
            result.metrics.update(run.runner.failures.metrics())
            return result

    def take_failures(self) -> FailureLog:
        """The failures of the runs since the last call (a rollout's, for its dump)."""
        log, self.failures = self.failures, FailureLog()
        return log

    async def generate_group(self, client: httpx.AsyncClient, group: Group, params: SamplingParams, seed: int,
                             what: str, evaluation: bool = False) -> Group:
        """One group generated in place, as a run would generate it (for rollout functions); returns it
        (a generate function may change its size)."""
        run = _Run(self.fleet, client, iter(()), Schedule(1, 1, None, False), params, seed, None, None, what,
                   self.custom, evaluation, self.policy)
        await run._generate([group], what)
        return group


class _Run:
    """One driver run: the started groups, in start order, and what became of each."""

    def __init__(self, fleet, client, groups, schedule: Schedule, params, seed, score, keep, what,
                 custom: CustomGenerate | None = None, evaluation: bool = False, policy: FailurePolicy | None = None):
        self.fleet, self.client, self.source, self.s = fleet, client, groups, schedule
        self.seed, self.what, self.evaluation = seed, what, evaluation
        self.runner = GroupRunner(fleet, params, score, keep, fleet.timeout_s, custom, evaluation, policy, what)
        self.started: list[Started] = []
        self.decided: list[Started] = []  # in the order they were kept or dropped
        self.cut = False  # set once the kept groups are known: later aborts are ours
        self.exhausted = False
        self.tag = uuid.uuid4().hex[:8]
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
        kept, reason = await self.runner.judge(item.samples, cut_by_us=self.cut)
        if kept is not None:  # None: cut short by our abort, neither kept nor dropped: it is unfinished
            item.kept, item.reason = kept, reason
            self.decided.append(item)
        if not self.evaluation:  # a storm of failures stops the rollout now, not when the data runs out
            self.runner.failures.check(self.runner.policy, self.s.need * len(item.samples), self.what)

    async def _generate(self, groups: list[Group], what: str, names: list[str] | None = None) -> None:
        """Generate these whole groups in place (one request, or each by its generate function)."""
        await self.runner.generate(self.client, groups, [self._seeds(g, len(g)) for g in groups],
                                   [self._rids(g) for g in groups], what, names, is_cut=lambda k: self.cut)

    def _span(self, items: list[Started]) -> str:
        return f"{self.what}, group {items[0].start}" if len(items) == 1 else \
            f"{self.what}, groups {items[0].start}..{items[-1].start}"

    async def _groups(self, items: list[Started]) -> None:
        """Generate these groups in one request (a generate function: each its own way), then judge them."""
        await self._generate([item.samples for item in items], self._span(items),
                             [self._span([item]) for item in items])
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
            for task in tasks:  # the first error is the one reported; the others' are collected quietly
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return self._result(cutoff)

    async def waves(self) -> DriverResult:
        cutoff = None
        while cutoff is None and not self.exhausted:
            wave = [item for item in (self._next() for _ in range(self.s.over_sampling_groups)) if item is not None]
            if not wave:
                break
            # One request per engine (whole groups each); a generate function works a group at a time.
            n = len(wave[0].samples)
            parts = [p for p in split_groups(len(wave) * n, n, self.fleet.num_engines) if p]
            shares = [wave[p.start // n:p.stop // n] for p in parts]
            await asyncio.gather(*(self._generate([item.samples for item in share], self._span(wave),
                                                  [self._span([item]) for item in share]) for share in shares))
            await asyncio.gather(*(self._judge(item) for item in wave))
            cutoff = self._cutoff()
        return self._result(cutoff)

    async def _abort(self, items: list[Started]) -> None:
        self.aborted_samples += await self.runner.abort(self.client, [r for item in items for r in self._rids(item.samples)])

    async def _abort_quietly(self, items: list[Started]) -> None:
        # Failing already: stop the engines' work on the other groups, without hiding the first error.
        try:
            await asyncio.wait_for(self._abort(items), 10)
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass

    def _result(self, chosen: list[Started] | None) -> DriverResult:
        exhausted = chosen is None
        if chosen is None:
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
