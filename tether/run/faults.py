"""Faults on purpose, for the tests that show a run survives them.

`TETHER_CRASH_AT=<point>:<rollout id>` kills the run right there: the whole process group gets
SIGKILL, as when a node dies or a job is preempted: nothing is flushed, no handler runs. Points:
generate, train, save, push (each while that work is in flight) and committed (just after a
checkpoint became visible).

`TETHER_ENGINE_FAULT=<KILL|STOP>:<n>:<marker file>` makes the first engine to receive its n-th
/generate request send itself SIGKILL (dies) or SIGSTOP (freezes, holding every request): the
marker file, created once, keeps its replacement and the other engines from doing the same.
`TETHER_ENGINE_UPDATE_FAULT=<n>:<marker file>` does the same (SIGKILL) at an engine's n-th weight
bucket, while the trainer pushes weights into it.

Unset, each costs one dict lookup.
"""

from __future__ import annotations

import itertools
import os
import signal

ENV = "TETHER_CRASH_AT"
ENGINE_FAULT = "TETHER_ENGINE_FAULT"
ENGINE_UPDATE_FAULT = "TETHER_ENGINE_UPDATE_FAULT"
_generate_requests = itertools.count(1)
_weight_buckets = itertools.count(1)


def crash_point(point: str, rollout_id: int) -> None:
    if os.environ.get(ENV) == f"{point}:{rollout_id}":
        os.killpg(os.getpgrp(), signal.SIGKILL)


def engine_fault() -> None:
    """Called by engine servers on each /generate request."""
    spec = os.environ.get(ENGINE_FAULT)
    if spec is None:
        return
    sig, n, marker = spec.split(":", 2)
    if next(_generate_requests) == int(n):
        _fire(marker, {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}[sig])


def engine_update_fault() -> None:
    """Called by engine actors on each weight bucket they load."""
    spec = os.environ.get(ENGINE_UPDATE_FAULT)
    if spec is None:
        return
    n, marker = spec.split(":", 1)
    if next(_weight_buckets) == int(n):
        _fire(marker, signal.SIGKILL)


def _fire(marker: str, sig: signal.Signals) -> None:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another engine had the fault already
        return
    os.kill(os.getpid(), sig)
