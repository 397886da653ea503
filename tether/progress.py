"""Progress reports from deep inside a rollout (an engine's reply, a tool's answer) to the stall watchdog
that guards it (tether/rollout/watchdog.py), without passing it through every signature: the
rollout sets a callback in its context, which the tasks it starts inherit."""

from __future__ import annotations

import contextvars
from typing import Callable

PROGRESS: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("tether_progress", default=None)


def report_progress() -> None:
    """Something completed (a request, a turn, a tool call): the rollout is not stalled."""
    callback = PROGRESS.get()
    if callback is not None:
        callback()
