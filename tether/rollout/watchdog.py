"""The stall watchdog: a rollout that makes no progress for ``rollout.failures.stall_timeout_s`` says so.

Every request, turn, tool call and score that completes is progress (tether/progress.py). When none
has come for the timeout while groups are waiting, the watchdog writes what it waited on: each
group, the engine serving it and where its coroutine is suspended (the innermost frames: a tool
that never answers shows up by its file and line). Then it fails the rollout (RolloutStalled), or,
with ``on_stall: drop``, cancels those groups: their samples fail with kind "stall" (masked, never
scored 0) and the rollout goes on without them.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, Awaitable, Callable, TypeVar

from tether.errors import RolloutStalled

T = TypeVar("T")
STACK_FRAMES = 4
"""Innermost frames shown per waiting branch of a group (one branch per sample still running) ..."""
STACKS = 4
"""... and at most this many branches."""


class Watchdog:
    def __init__(self, timeout_s: float | None, drop: bool, what: str):
        self.timeout_s, self.drop, self.what = timeout_s, drop, what
        self.last = time.monotonic()
        self.waiting: dict[asyncio.Task, tuple[str, Callable[[], str]]] = {}
        self.dropped: set[asyncio.Task] = set()
        self.active = True  # off while nothing is meant to progress (a paused stream)
        self.stalls = 0

    def progress(self) -> None:
        self.last = time.monotonic()

    async def guard(self, work: Awaitable[T], name: str, engine: Callable[[], str]) -> tuple[bool, T | None]:
        """Run one group's work watched: (True, its result), or (False, None) when a stall dropped it."""
        task = asyncio.ensure_future(work)
        self.waiting[task] = (name, engine)
        try:
            return True, await task
        except asyncio.CancelledError:
            # Ours, unless this coroutine is being cancelled too (Task.cancelling: Python 3.11+).
            cancelling = getattr(asyncio.current_task(), "cancelling", lambda: 0)()
            if task in self.dropped and not cancelling:
                return False, None
            raise
        finally:
            self.waiting.pop(task, None)
            self.dropped.discard(task)
            self.progress()

    async def run(self) -> None:
        """Check until cancelled; raises RolloutStalled at a stall unless stalled groups are dropped."""
        if self.timeout_s is None:
            await asyncio.Event().wait()  # never fires
        assert self.timeout_s is not None
        period = min(5.0, self.timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            if not self.active or not self.waiting:
                self.progress()  # idle time is not a stall
                continue
            idle = time.monotonic() - self.last
            if idle < self.timeout_s:
                continue
            report = self.report(idle)
            if not self.drop:
                raise RolloutStalled(report)
            self.stalls += 1
            print(f"[tether] {report}\n  dropping them (rollout.failures.on_stall: drop)", file=sys.stderr, flush=True)
            for task in list(self.waiting):
                self.dropped.add(task)
                task.cancel()
            self.progress()

    def report(self, idle: float) -> str:
        lines = [f"{self.what}: no request, turn, tool call or score completed for {idle:.0f}s "
                 f"(rollout.failures.stall_timeout_s={self.timeout_s:g}); waiting on {len(self.waiting)} group(s):"]
        for task, (name, engine) in self.waiting.items():
            lines.append(f"  {name}, on engine {engine()}, waiting at:")
            for chain in suspended_at(task)[:STACKS]:
                lines += [f"    {frame}" for frame in chain[-STACK_FRAMES:]]
                lines.append("    --")
            lines.pop()
        return "\n".join(lines)


def suspended_at(task: asyncio.Task, depth: int = 0) -> list[list[str]]:
    """Where a task's coroutine chain is suspended, outermost frame first ("file:line in function"): one
    chain per branch still waiting (a gather's unfinished children each get their own)."""
    frames: list[str] = []
    coro: Any = task.get_coro()
    for _ in range(64):  # coroutines and generators alike: typed loosely
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    # The future the task waits on: another task, or a gather of tasks, whose own stacks go on from here.
    waiter = getattr(task, "_fut_waiter", None)
    children = [waiter] if isinstance(waiter, asyncio.Task) else list(getattr(waiter, "_children", None) or [])
    waiting = [c for c in children if isinstance(c, asyncio.Task) and not c.done()]
    if waiting and depth < 4:
        return [frames + chain for child in waiting for chain in suspended_at(child, depth + 1)]
    return [frames]


async def watched(main: Awaitable[T], watchdog: Watchdog) -> T:
    """Run ``main`` with the watchdog beside it: a RolloutStalled from the watchdog cancels ``main``."""
    work, watch = asyncio.ensure_future(main), asyncio.ensure_future(watchdog.run())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        watch.result()  # raises RolloutStalled
        raise AssertionError("the watchdog returned")  # run() only ever raises
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
