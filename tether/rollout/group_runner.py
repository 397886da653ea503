"""One group's way through the engines, the same under every schedule.

A group is the n samples of one prompt. Whatever decides when groups start and which are kept (the
batch driver of a synchronous rollout, rollout/driver.py; the stream of a fully asynchronous one,
rollout/stream.py), each group goes the same way:

    generate ──▶ judge: cut short by us? ──▶ unfinished (the schedule continues or drops it)
       │                aborted by the engine? ──▶ dropped ("aborted_by_engine")
       │                otherwise: score (failed samples are not: they are masked), then
       │                  every sample failed? ──▶ dropped ("failed"; or kept, trained on nothing)
       │                  the filter's verdict on the others ──▶ kept | dropped (its reason)
       └─ plain groups: one /generate request (several groups may share it); a lost engine's request
          is re-sent by the fleet. A group with a generate function (the run's or its data row's): the
          function, on one engine for all its turns; when that engine is lost, the group starts
          again from what it was on another.

The schedule gives each sample its seed and request id (they define what it samples, and what an
abort reaches) and says whether a group has been cut (a generate function starts no new turn then).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time
from typing import Awaitable, Callable

import httpx

from tether.engine.sampling import SamplingParams
from tether.progress import PROGRESS
from tether.rollout.failures import FailureLog, FailurePolicy
from tether.rollout.fleet import EngineFleet
from tether.rollout.generate_fn import CustomGenerate, GenerateError, group_tokens, lost_connection
from tether.rollout.router import EngineLost
from tether.rollout.watchdog import Watchdog
from tether.sample import UNSCORED, Sample, counted

Group = list[Sample]
ScoreFn = Callable[[Group], Awaitable[None]]
KeepFn = Callable[[Group], tuple[bool, str]]
ABORTED_BY_ENGINE = "aborted_by_engine"
FAILED = "failed"


class GroupRunner:
    def __init__(self, fleet: EngineFleet, params: SamplingParams, score: ScoreFn | None, keep: KeepFn | None,
                 timeout_s: float, custom: CustomGenerate | None = None, evaluation: bool = False,
                 policy: FailurePolicy | None = None, what: str = "rollout"):
        """``timeout_s``: for scoring a group, and for each request of a generate function; ``policy``:
        what becomes of failed samples (rollout.failures)."""
        self.fleet, self.params, self.score, self.keep = fleet, params, score, keep
        self.custom, self.evaluation = custom, evaluation
        self.timeout_s = timeout_s
        self.policy = policy or (custom.policy if custom is not None else FailurePolicy())
        self.reward_s = 0.0  # scoring time, summed over the groups judged
        self.failures = FailureLog()  # of the groups judged (the schedule reads and resets it)
        self.watchdog = Watchdog(self.policy.stall_timeout_s, self.policy.drop_on_stall, what)
        self.engines: dict[str, str] = {}  # group name -> the engine its generate function leased

    async def generate(self, client: httpx.AsyncClient, groups: list[Group], seeds: list[list[int]],
                       rids: list[list[str]], what: str, names: list[str] | None = None,
                       is_cut: Callable[[int], bool] = lambda k: False) -> None:
        """Generate these groups in place: in one request, or, when the run has generate functions,
        each group on its own (by its function, or a request of its own when it has none).
        ``seeds`` and ``rids``: per group, one per sample. ``what`` names them all in errors,
        ``names`` each group; ``is_cut(k)``: whether group k was cut (its function starts no new turn).
        A generate function may change its group's size (in place). Each unit of work is watched for
        stalls (tether/rollout/watchdog.py): one dropped by the watchdog comes back failed ("stall")."""
        PROGRESS.set(self.watchdog.progress)  # the tasks started below report to it
        if self.custom is None:
            ok, _ = await self.watchdog.guard(
                self.fleet.generate(client, [s for g in groups for s in g], self.params,
                                    [x for group_seeds in seeds for x in group_seeds],
                                    [r for group_rids in rids for r in group_rids], what), what,
                lambda: "chosen by the router")
            if not ok:
                await self._stalled(client, groups, [r for group_rids in rids for r in group_rids])
            return
        names = names or [what] * len(groups)
        await asyncio.gather(*(self._watched(client, g, seeds[k], rids[k], names[k], functools.partial(is_cut, k))
                               for k, g in enumerate(groups)))

    async def _watched(self, client: httpx.AsyncClient, samples: Group, seeds: list[int], rids: list[str],
                       what: str, is_cut: Callable[[], bool]) -> None:
        ok, _ = await self.watchdog.guard(self._one(client, samples, seeds, rids, what, is_cut), what,
                                          lambda: self.engines.get(what, "none leased yet"))
        self.engines.pop(what, None)
        if not ok:
            await self._stalled(client, [samples], rids)

    async def _stalled(self, client: httpx.AsyncClient, groups: list[Group], rids: list[str]) -> None:
        """Groups the watchdog dropped: their samples fail ("stall"), their requests are stopped."""
        for group in groups:
            for s in group:
                if not s.failed:
                    s.status = "failed"
                    s.fail("stall", f"dropped by the stall watchdog after rollout.failures.stall_timeout_s="
                                    f"{self.policy.stall_timeout_s:g}s without progress")
        try:
            await asyncio.wait_for(self.abort(client, rids), 10)
        except Exception:  # noqa: BLE001 - the engine may be the thing that hangs; the group is dropped anyway
            pass

    async def _one(self, client: httpx.AsyncClient, samples: Group, seeds: list[int], rids: list[str],
                   what: str, is_cut: Callable[[], bool]) -> None:
        assert self.custom is not None  # generate() runs a group on its own only with generate functions
        spec = self.custom.spec_for(samples[0])
        if spec is None:
            return await self.fleet.generate(client, samples, self.params, seeds, rids, what)
        router = self.fleet.router
        while True:
            # A group whose engine is lost starts again, from what it was, on another engine.
            before = copy.deepcopy(samples) if self.fleet.reissue else None
            url = None
            try:
                async with router.lease_async(group_tokens(samples, self.params)) as url:
                    self.engines[what] = url
                    samples[:] = await self.custom.generate_group(spec, list(samples), self.params, url, client, seeds,
                                                                  rids, is_cut, self.timeout_s, self.evaluation)
                return
            except (EngineLost, GenerateError) as err:
                cause = lost_connection(err)
                if before is None:
                    raise
                if cause is not None:
                    reason = f"{type(cause).__name__}: {cause}"
                elif isinstance(err, EngineLost):
                    reason = err.reason
                else:
                    raise
                if url is not None:  # else lost before the lease began (Router.bound refused it): marked already
                    router.mark_lost(url, reason)
                samples[:] = before
                self.fleet.reissued_samples += len(samples)

    async def judge(self, samples: Group, cut_by_us: bool) -> tuple[bool | None, str]:
        """(kept, reason) of a generated group: None when our own abort cut it short (unfinished:
        the schedule decides what becomes of it); dropped when the engine gave up on it (its request
        timeout); else scored and put to the filter."""
        if any(s.status == "aborted" and not s.failed for s in samples):
            return (None, "") if cut_by_us else (False, ABORTED_BY_ENGINE)
        # Judging runners have both; only generate_group's (rollout functions) has neither, and never judges.
        assert self.score is not None and self.keep is not None
        start = time.perf_counter()
        # The scorer's own retries each have reward_timeout_s; this bounds a scorer that never returns.
        await asyncio.wait_for(self.score(samples), self.timeout_s * self.policy.attempts("reward"))
        self.reward_s += time.perf_counter() - start
        self.watchdog.progress()
        self.failures.add_group(samples)
        live = counted(samples)
        if not live and self.evaluation:  # an eval keeps every group (its score is over what did not fail)
            return True, ""
        if not live:  # nothing to learn from: replaced by another prompt, or kept as a place holder
            # A group its reward left unscored (None: "not scored") is kept, trained on nothing, as TRL
            # does; min_trained_frac says when that is too much.
            unscored = all(s.failure is not None and s.failure["kind"] == UNSCORED for s in samples)
            return (False, FAILED) if self.policy.replace_groups and not unscored else (True, "")
        return self.keep(live) if len(live) < len(samples) else self.keep(samples)

    async def abort(self, client: httpx.AsyncClient, rids: list[str]) -> int:
        """Stop these requests on the engines; returns how many were asked to stop."""
        if rids:
            await self.fleet.abort(client, rids)
        return len(rids)
