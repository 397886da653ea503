"""Crash points for resume tests: `TETHER_CRASH_AT=<point>:<rollout id>` kills the run right there.

The whole process group gets SIGKILL, as when a node dies or a job is preempted: nothing is
flushed, no handler runs. Points: generate, train, save, push (each while that work is in flight)
and committed (just after a checkpoint became visible). Unset, this costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "TETHER_CRASH_AT"


def crash_point(point: str, rollout_id: int) -> None:
    if os.environ.get(ENV) == f"{point}:{rollout_id}":
        os.killpg(os.getpgrp(), signal.SIGKILL)
