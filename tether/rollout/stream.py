"""The fully asynchronous rollout (``rollout.async_mode: fully_async``): groups stream through the
engines across train steps, and the trainer takes the next batch from what has finished.

    draw a prompt ─▶ generate its group ─▶ score ─▶ filter ─▶ ready ──take(r)──▶ trainer
                          ▲                                      │ older than max_staleness versions
                          └──────────── retry ◀──────────────────┘ (or drop)

A background event loop (its own thread in the rollout manager) keeps groups in flight, one
/generate request each. Staleness: a group taken for rollout r (trained by the policy of version r)
is r minus the oldest weight version among its tokens; ``take`` hands out only groups at most
``max_staleness`` behind, and a staler one is regenerated from its prompt (``retry``) or dropped.

How many groups may be outstanding (generating or ready): a group started under version v can be
trained at rollouts v .. v + max_staleness, so never more than those rollouts will take:
``(version + max_staleness - next_take + 1) * need``, at most ``max_concurrent_groups`` generating.
The stream fills that window only while the trainer waits for a take (the engines are then the
bottleneck and more groups at once make bigger batches); otherwise it keeps one take's worth
outstanding, so that engines faster than the trainer do not make every batch max_staleness old.
With a dynamic filter, ``over_sampling_groups`` raises "one take's worth" (and the window) by the
groups the filter is expected to drop.

Each group goes through the group runner (rollout/group_runner.py), as in the synchronous rollout:
one request, or the group's generate function (the run's or its data row's), scored and judged.

Weight updates happen between ``pause`` and ``resume``. ``in_place``: the engines hold running
requests and continue them under the new weights with their KV cache (the engine reports which
weights sampled which tokens, so each token's version is exact). ``recompute``: running requests are
aborted and continued after the update, their prompt and partial response prefilled again under the
new weights. A group in flight that no later take could use is cut at ``resume``.

Prompts are drawn one at a time through the epochs in the data source's order (the same rows per
epoch as the synchronous loop). ``state_dict`` holds the position and every drawn, untrained group
(ready ones with their samples, generating ones as their prompt): resumed from a checkpoint, every
prompt is trained once (or dropped as stale), none twice.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, Literal

import httpx

from tether.engine.sampling import SamplingParams
from tether.http.client import async_client, engine_headers, pool_limits
from tether.rollout.data_source import DataSource
from tether.rollout.fleet import EngineFleet
from tether.rollout.generate_fn import CustomGenerate
from tether.rollout.failures import FailureLog, FailurePolicy
from tether.rollout.group_runner import GroupRunner
from tether.sample import Sample, sample_from_dict
from tether.errors import TIMEOUTS, RolloutStalled

Group = list[Sample]
STREAM_STATE = "rollout_stream.json"  # an older checkpoint's file; now the "stream" of data_source.json
MAX_RETRIES = 3
"""A group regenerated this many times and still too old is dropped: its responses take longer than
max_staleness train steps to generate, so retrying it again would only loop."""


class StreamTimeout(TimeoutError):
    pass


@dataclass
class Flight:
    """A group drawn from the data and not yet trained on."""

    seq: int
    """Draw order: seeds, request ids, and the order among groups of the same age."""
    samples: Group
    version: int
    """The engines' weight version when it (re)started: the oldest its tokens can be."""
    epoch: int
    attempt: int = 0
    rids: list[str] = field(default_factory=list)
    cut: str | None = None
    """Why we aborted it while it ran: "pause" (continue after the update) or "stale"."""

    def oldest(self) -> int:
        # Tokens inserted before the policy's first reply (an agent's opening turn) have no version: -1.
        versions = [v for s in self.samples for v, n in zip(s.weight_versions, s.span_lengths) if n > 0 and v >= 0]
        return min(versions, default=self.version)

    def to_dict(self) -> dict:
        return {"seq": self.seq, "version": self.version, "epoch": self.epoch, "attempt": self.attempt,
                "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict) -> Flight:
        return cls(d["seq"], [sample_from_dict(row) for row in d["samples"]], d["version"], d["epoch"], d["attempt"])


@dataclass
class StreamSettings:
    need: int
    """Groups per take (rollout.prompts_per_rollout)."""
    max_staleness: int
    start_per_take: int
    """Groups kept outstanding per take (rollout.over_sampling_groups, at least ``need``): those over
    ``need`` stand in for groups the dynamic filter will drop, so that a take does not wait for them."""
    max_in_flight: int | None
    """Most groups generating at once (rollout.max_concurrent_groups); None: as many as may be outstanding."""
    stale_groups: Literal["drop", "retry"]
    groups_per_request: int
    pause_mode: Literal["in_place", "recompute"]
    seed: int
    timeout_s: float
    policy: FailurePolicy = FailurePolicy()
    """Retries, masking and budgets of failed samples (rollout.failures); the budgets count per take."""


class RolloutStream:
    def __init__(self, fleet: EngineFleet, data: DataSource, params: SamplingParams, settings: StreamSettings,
                 score: Callable[[Group], Awaitable[None]], keep: Callable[[Group], tuple[bool, str]],
                 custom: CustomGenerate | None = None):
        self.fleet, self.data, self.params, self.s = fleet, data, params, settings
        self.runner = GroupRunner(fleet, params, score, keep, settings.timeout_s, custom, policy=settings.policy,
                                  what="rollout stream")
        self.position = (0, 0)  # (epoch, offset) of the next prompt to draw
        self.next_seq = 0
        self.queue: deque[Flight] = deque()  # to (re)start before new prompts, oldest first
        self.running: dict[int, Flight] = {}
        self.ready: list[Flight] = []
        self.version = 0
        self.next_take = 0
        self.trainer_waits = False  # a take is waiting for groups
        self.paused = True
        self.counts: Counter = Counter()  # since the last take
        self.totals: Counter = Counter()
        self.dropped: list[Flight] = []  # stale groups dropped since the last take
        self.taken_failures = FailureLog()  # the failed samples judged before the last take
        self.error: BaseException | None = None
        self.busy_s = 0.0  # engines generating stream groups, unpaused
        self._busy_from: float | None = None
        self.tag = uuid.uuid4().hex[:8]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-stream", daemon=True)
        self.thread.start()
        # Made on the loop, by _setup, before this returns.
        self.client: httpx.AsyncClient
        self.changed: asyncio.Event
        self._on_loop(self._setup)

    # ------------------------------------------------------------ called from the manager's thread
    def _on_loop(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(*args), self.loop).result(timeout)

    def start(self, version: int, next_take: int) -> None:
        """Start streaming under weight ``version``; the next take is rollout ``next_take``."""
        self._on_loop(self._start, version, next_take)

    def take(self, rollout_id: int) -> tuple[list[Flight], dict[str, float]]:
        """The next ``need`` groups at most max_staleness versions behind rollout_id (waits for them)."""
        return self._on_loop(self._take, rollout_id)

    def pause(self) -> None:
        """No group starts; running requests hold (in_place) or are aborted to continue later (recompute)."""
        self._on_loop(self._pause, timeout=self.s.timeout_s)

    def resume(self, version: int) -> None:
        """The engines now serve ``version``: continue."""
        self._on_loop(self._resume, version, timeout=self.s.timeout_s)

    def state_dict(self) -> dict:
        return self._on_loop(self._state)

    def load_state_dict(self, state: dict) -> None:
        self._on_loop(self._load, state)

    def close(self) -> None:
        if self.loop.is_running():
            self._on_loop(self._close, timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)

    # ------------------------------------------------------------ on the loop
    async def _setup(self) -> None:
        self.client = async_client(self.s.timeout_s, limits=pool_limits(max_connections=None, max_keepalive=64),
                                   headers=engine_headers())
        self.changed = asyncio.Event()
        self.runner.watchdog.active = False
        self.stall_watch = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """The stall watchdog, while the stream runs unpaused: a stall fails the next take."""
        try:
            await self.runner.watchdog.run()
        except RolloutStalled as err:
            self.error = err
            self.changed.set()

    async def _close(self) -> None:
        self.paused = True
        await self._abort(list(self.running.values()))
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()

    async def _start(self, version: int, next_take: int) -> None:
        self.version, self.next_take = version, next_take
        self._set_paused(False)
        self._fill()

    def _set_paused(self, paused: bool) -> None:
        self._account()
        self.paused = paused
        self.runner.watchdog.active = not paused
        self.runner.watchdog.progress()
        self._account()

    def _account(self) -> None:
        """Count the time the engines had stream groups to generate (for perf/rollout_idle_frac)."""
        now = time.perf_counter()
        if self._busy_from is not None:
            self.busy_s += now - self._busy_from
        self._busy_from = now if self.running and not self.paused else None

    def _capacity(self) -> int:
        """Groups that may be outstanding: those the takes up to version + max_staleness will use, and
        the over-sampled ones."""
        extra = self.s.start_per_take - self.s.need
        return (self.version + self.s.max_staleness - self.next_take + 1) * self.s.need + extra

    def _fill(self) -> None:
        """Start groups while there is room, up to groups_per_request of them to a request."""
        if self.paused or self.error is not None:
            return
        cap = self._capacity() if self.trainer_waits else min(self._capacity(), self.s.start_per_take)
        limit = self.s.max_in_flight or cap
        batch: list[Flight] = []
        while len(self.running) < limit and len(self.running) + len(self.ready) < cap:
            flight = self.queue.popleft() if self.queue else self._draw()
            if flight.oldest() < self.next_take - self.s.max_staleness:  # continued too late to be used
                self._stale(flight)
                continue
            if flight.version < self.version and not any(s.response_ids for s in flight.samples):
                flight.version = self.version  # nothing generated yet: its tokens will be this version's
            for s in flight.samples:  # what a generate function sees as ctx.rollout_id (the take sets it again)
                s.rollout_id = flight.version
            self.running[flight.seq] = flight
            batch.append(flight)
            if len(batch) == self.s.groups_per_request:
                asyncio.get_running_loop().create_task(self._run(batch))
                batch = []
        if batch:
            asyncio.get_running_loop().create_task(self._run(batch))
        self._account()

    def _draw(self) -> Flight:
        epoch, offset = self.position
        if offset >= self.data.num_rollout_per_epoch * self.data.prompts_per_rollout:
            epoch, offset = epoch + 1, 0  # the same usable rows per epoch as rollout-sized draws
        row = self.data.rows[int(self.data.epoch_order(epoch)[offset])]
        self.position = (epoch, offset + 1)
        flight = Flight(self.next_seq, self.data.group(row, 0), self.version, epoch)
        self.next_seq += 1
        return flight

    def _seeds_and_rids(self, flight: Flight) -> tuple[list[int], list[str]]:
        base = (self.s.seed * 1_000_003 + flight.seq) * 7919 + flight.attempt
        seeds = [(base * 1_000_033 + s.sample_index) % (1 << 62) for s in flight.samples]
        return seeds, [f"{self.tag}-{flight.seq}-{flight.attempt}-{s.sample_index}" for s in flight.samples]

    async def _run(self, flights: list[Flight]) -> None:
        """Generate these groups in one request (or each by its generate function), then score and
        judge each (or requeue the ones we cut)."""
        try:
            seeds = []
            for flight in flights:
                group_seeds, flight.rids = self._seeds_and_rids(flight)
                seeds.append(group_seeds)
            names = [f"rollout stream, group {f.seq} (prompt {f.samples[0].prompt_index})" for f in flights]
            what = names[0] if len(flights) == 1 else "rollout stream, " + ", ".join(
                n.removeprefix("rollout stream, ") for n in names)
            await self.runner.generate(self.client, [f.samples for f in flights], seeds, [f.rids for f in flights],
                                       what, names, is_cut=lambda k: flights[k].cut is not None)
            for flight in flights:
                cut_short = any(s.status == "aborted" for s in flight.samples)
                if flight.cut == "pause" and not cut_short:
                    flight.cut = None  # our abort came after it finished: it is done
                if flight.cut is None:
                    await self._judge(flight)
        except Exception as err:  # noqa: BLE001 - take() raises it in the manager, naming the group
            self.error = err
        finally:
            for flight in flights:
                self.running.pop(flight.seq, None)
                if flight.cut == "pause":
                    self._requeue(flight)
                elif flight.cut == "stale":
                    self._stale(flight)
            self._account()
            self.changed.set()
            self._fill()

    async def _judge(self, flight: Flight) -> None:
        kept, reason = await self.runner.judge(flight.samples, cut_by_us=False)
        if kept:
            self.ready.append(flight)
        else:
            self.counts[f"dropped/{reason or 'filtered'}"] += 1
        # The stream runs ahead of the takes (up to max_staleness of them): the budget is a share of what
        # it judged, at least one take's worth.
        failures = self.runner.failures
        failures.check(self.s.policy, max(self.s.need * len(flight.samples), failures.judged),
                       f"rollout stream, before take {self.next_take}")

    def _requeue(self, flight: Flight) -> None:
        """Back to the queue, in draw order (a continued group keeps its partial responses)."""
        flight.cut = None
        self.queue.append(flight)
        self.queue = deque(sorted(self.queue, key=lambda f: f.seq))

    def _stale(self, flight: Flight) -> None:
        self.counts["stale"] += 1
        if self.s.stale_groups == "drop" or flight.attempt >= MAX_RETRIES:
            if flight.attempt >= MAX_RETRIES:
                self.counts["dropped/stale_after_retries"] += 1
            self.dropped.append(flight)
            return
        self.counts["retried"] += 1
        prompt = self.data.rows[flight.samples[0].prompt_index]
        flight.samples, flight.attempt, flight.version = self.data.group(prompt, 0), flight.attempt + 1, self.version
        self._requeue(flight)

    async def _take(self, rollout_id: int) -> tuple[list[Flight], dict[str, float]]:
        start = time.perf_counter()
        self.next_take = rollout_id
        oldest_ok = rollout_id - self.s.max_staleness
        while True:
            if self.error is not None:
                raise self.error
            for flight in [f for f in self.ready if f.oldest() < oldest_ok]:
                self.ready.remove(flight)
                self._stale(flight)
            if len(self.ready) >= self.s.need:
                break
            self.trainer_waits = True
            self._fill()
            self.changed.clear()
            left = self.s.timeout_s - (time.perf_counter() - start)
            try:
                await asyncio.wait_for(self.changed.wait(), max(left, 0.0))
            except TIMEOUTS:
                self.trainer_waits = False
                raise StreamTimeout(
                    f"rollout {rollout_id}: waited {self.s.timeout_s:.0f}s for {self.s.need} groups at most "
                    f"{self.s.max_staleness} weight versions old; {len(self.ready)} ready, {len(self.running)} "
                    f"generating, engines at version {self.version}") from None
        self.trainer_waits = False
        self.ready.sort(key=lambda f: (f.oldest(), f.seq))
        taken, self.ready = self.ready[:self.s.need], self.ready[self.s.need:]
        self.next_take = rollout_id + 1
        self._fill()
        return taken, self._take_metrics(time.perf_counter() - start)

    def _take_metrics(self, wait_s: float) -> dict[str, float]:
        self._account()
        self.totals.update(self.counts)
        self.totals["taken"] += self.s.need
        metrics = {f"async/groups_{key}": float(n) for key, n in self.counts.items()}
        dropped = self.totals["stale"] - self.totals["retried"]
        metrics.update({"async/take_wait_s": wait_s, "async/ready_groups": float(len(self.ready)),
                        "async/generating_groups": float(len(self.running)),
                        "async/dropped_stale_frac": dropped / max(1, dropped + self.totals["taken"]),
                        "async/engine_busy_s": self.busy_s})
        metrics.update(self.runner.failures.metrics())
        self.taken_failures, self.runner.failures = self.runner.failures, FailureLog()
        self.counts.clear()
        self.busy_s = 0.0
        return metrics

    async def _pause(self) -> None:
        self._set_paused(True)
        if self.s.pause_mode == "in_place":
            # SGLang's default pause mode aborts; "in_place" keeps running requests and their KV.
            await asyncio.to_thread(self.fleet.router.broadcast, "/pause_generation", {"mode": "in_place"})
            return
        for flight in self.running.values():
            flight.cut = "pause"
        while self.running:  # an abort can pass a request still on its way to the engine: repeat
            await self._abort(list(self.running.values()))
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 0.2)
            except TIMEOUTS:
                pass

    async def _resume(self, version: int) -> None:
        self.version = version
        if self.s.pause_mode == "in_place":
            await asyncio.to_thread(self.fleet.router.broadcast, "/continue_generation")
        # The next take is next_take; a group whose tokens are older than it allows is cut now.
        doomed = [f for f in self.running.values() if f.version < self.next_take - self.s.max_staleness]
        for flight in doomed:
            flight.cut = "stale"
        await self._abort(doomed)
        self._set_paused(False)
        self._fill()

    async def _abort(self, flights: list[Flight]) -> None:
        await self.runner.abort(self.client, [rid for f in flights for rid in f.rids])

    async def _state(self) -> dict:
        def restart(f: Flight) -> Flight:  # generating now: saved as its prompt, generated again on resume
            prompt = self.data.rows[f.samples[0].prompt_index]
            return Flight(f.seq, self.data.group(prompt, 0), f.version, f.epoch, f.attempt + 1)
        pending = sorted(list(self.queue) + [restart(f) for f in self.running.values()], key=lambda f: f.seq)
        return {"position": list(self.position), "next_seq": self.next_seq, "totals": dict(self.totals),
                "ready": [f.to_dict() for f in self.ready], "pending": [f.to_dict() for f in pending]}

    async def _load(self, state: dict) -> None:
        self.position, self.next_seq = tuple(state["position"]), state["next_seq"]
        self.totals = Counter(state["totals"])
        self.ready = [Flight.from_dict(d) for d in state["ready"]]
        self.queue = deque(Flight.from_dict(d) for d in state["pending"])


def staleness_metrics(groups: list[Group], rollout_id: int) -> dict[str, float]:
    """How many versions behind rollout_id the trained tokens were sampled: the mean, the largest, and
    the share of tokens at each staleness (async/staleness_tokens/<versions behind>)."""
    behind: Counter = Counter()
    for s in (s for g in groups for s in g):
        for version, n in zip(s.weight_versions, s.span_lengths):
            if version >= 0:  # -1: tokens inserted before any policy reply
                behind[rollout_id - version] += n
    total = sum(behind.values())
    if not total:
        return {}
    out = {f"async/staleness_tokens/{k}": n / total for k, n in sorted(behind.items())}
    out["async/staleness_mean"] = sum(k * n for k, n in behind.items()) / total
    out["async/staleness_max"] = float(max(behind))
    return out
