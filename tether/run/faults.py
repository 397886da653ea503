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

`TETHER_INJECT_FAULTS=tool=0.1,environment=0.1,reward=0.1,seed=0` makes that share of tool calls,
environment calls and reward calls fail (ToolFailure, EnvironmentFailure, a reward error), each
decided by a hash of the seed, the sample (rollout, prompt, sample index), its attempt and the call's
number within it: the same calls fail on every run, whatever the order in which they happen.

Unset, each costs one dict lookup.
"""

from __future__ import annotations

import contextvars
import hashlib
import itertools
import os
import signal
from dataclasses import dataclass, field

ENV = "TETHER_CRASH_AT"
ENGINE_FAULT = "TETHER_ENGINE_FAULT"
ENGINE_UPDATE_FAULT = "TETHER_ENGINE_UPDATE_FAULT"
INJECT_FAULTS = "TETHER_INJECT_FAULTS"
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


@dataclass
class SampleCall:
    """The sample whose generate function is running (set per sample and attempt), so that its tool and
    environment calls can be told apart: which sample, which attempt, how many calls so far."""

    key: tuple
    attempt: int
    calls: dict[str, int] = field(default_factory=dict)


CURRENT_SAMPLE: contextvars.ContextVar[SampleCall | None] = contextvars.ContextVar("tether_sample_call", default=None)


def inject_fault(kind: str, key: tuple | None = None) -> bool:
    """Whether this call of ``kind`` (tool, environment, reward) is made to fail (TETHER_INJECT_FAULTS).
    ``key``: the call's identity; by default the running sample's, its attempt and its count of such
    calls."""
    spec = os.environ.get(INJECT_FAULTS)
    if not spec:
        return False
    rates = dict(part.split("=", 1) for part in spec.split(",") if part)
    rate = float(rates.get(kind, 0))
    if rate <= 0:
        return False
    if key is None:
        current = CURRENT_SAMPLE.get()
        if current is None:
            return False
        n = current.calls.get(kind, 0)
        current.calls[kind] = n + 1
        key = (*current.key, current.attempt, n)
    digest = hashlib.blake2b(repr((rates.get("seed", "0"), kind, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2 ** 64 < rate
