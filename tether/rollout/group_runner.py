"""One group's way through the engines, the same under every schedule.

A group is the n samples of one prompt. Whatever decides when groups start and which are kept (the
batch driver of a synchronous rollout, rollout/driver.py; the stream of a fully asynchronous one,
rollout/stream.py), each group goes the same way:

    generate ──▶ judge: cut short by us? ──▶ unfinished (the schedule continues or drops it)
       │                aborted by the engine? ──▶ dropped ("aborted_by_engine")
       │                otherwise: score, then the filter's verdict ──▶ kept | dropped (its reason)
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
from tether.rollout.fleet import EngineFleet
from tether.rollout.generate_fn import CustomGenerate, GenerateError, group_tokens
from tether.rollout.router import EngineLost
from tether.sample import Sample

Group = list[Sample]
ScoreFn = Callable[[Group], Awaitable[None]]
KeepFn = Callable[[Group], tuple[bool, str]]
ABORTED_BY_ENGINE = "aborted_by_engine"


class GroupRunner:
    def __init__(self, fleet: EngineFleet, params: SamplingParams, score: ScoreFn | None, keep: KeepFn | None,
                 timeout_s: float, custom: CustomGenerate | None = None, evaluation: bool = False):
        """``timeout_s``: for scoring a group, and for each request of a generate function."""
        self.fleet, self.params, self.score, self.keep = fleet, params, score, keep
        self.custom, self.evaluation = custom, evaluation
        self.timeout_s = timeout_s
        self.reward_s = 0.0  # scoring time, summed over the groups judged

    async def generate(self, client: httpx.AsyncClient, groups: list[Group], seeds: list[list[int]],
                       rids: list[list[str]], what: str, names: list[str] | None = None,
                       is_cut: Callable[[int], bool] = lambda k: False) -> None:
        """Generate these groups in place: in one request, or, when the run has generate functions,
        each group on its own (by its function, or a request of its own when it has none).
        ``seeds`` and ``rids``: per group, one per sample. ``what`` names them all in errors,
        ``names`` each group; ``is_cut(k)``: whether group k was cut (its function starts no new turn).
        A generate function may change its group's size (in place)."""
        if self.custom is None:
            await self.fleet.generate(client, [s for g in groups for s in g], self.params,
                                      [x for group_seeds in seeds for x in group_seeds],
                                      [r for group_rids in rids for r in group_rids], what)
            return
        names = names or [what] * len(groups)
        await asyncio.gather(*(self._one(client, g, seeds[k], rids[k], names[k], functools.partial(is_cut, k))
                               for k, g in enumerate(groups)))

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
                    samples[:] = await self.custom.generate_group(spec, list(samples), self.params, url, client, seeds,
                                                                  rids, is_cut, self.timeout_s, self.evaluation)
                return
            except (EngineLost, GenerateError) as err:
                cause = err.__cause__
                connection = isinstance(cause, httpx.TransportError) and not isinstance(cause, httpx.TimeoutException)
                if before is None:
                    raise
                if connection:
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
        if any(s.status == "aborted" for s in samples):
            return (None, "") if cut_by_us else (False, ABORTED_BY_ENGINE)
        # Judging runners have both; only generate_group's (rollout functions) has neither, and never judges.
        assert self.score is not None and self.keep is not None
        start = time.perf_counter()
        await asyncio.wait_for(self.score(samples), self.timeout_s)
        self.reward_s += time.perf_counter() - start
        return self.keep(samples)

    async def abort(self, client: httpx.AsyncClient, rids: list[str]) -> int:
        """Stop these requests on the engines; returns how many were asked to stop."""
        if rids:
            await self.fleet.abort(client, rids)
        return len(rids)
