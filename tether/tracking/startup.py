"""Where start-up time goes: phases timed as they finish, printed as one line before the first rollout.

    [tether] ready in 10.8s: imports 1.9s, ray 2.7s, actors 5.1s (engines 4.6s, rollout manager 5.1s,
    trainer ready), trainer init 0.6s, first weight push 0.05s, eval at step 0 0.4s

Phases that overlap (actors start together) are reported by when each became ready, within the
phase that waited for them.
"""

from __future__ import annotations

import os
import sys
import time


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): the interpreter and imports."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 is the start time in clock ticks after boot; the command name (field 2) may
            # contain spaces, so count from the closing parenthesis.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return max(0.0, time.time() - (boot + start_ticks / os.sysconf("SC_CLK_TCK")))


class StartupClock:
    """Laps since the previous one; ``detail`` adds the parallel parts finished within the last lap."""

    def __init__(self, count_process: bool = True):
        age = process_age_s() if count_process else None
        self._last = time.perf_counter()
        self.start = self._last - (age or 0.0)
        self.laps: list[tuple[str, float, str]] = [("imports", age, "")] if age is not None else []

    def lap(self, name: str, detail: str = "") -> float:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.laps.append((name, seconds, detail))
        return seconds

    def since_last(self) -> float:
        """Seconds into the current (unfinished) lap: when a parallel part became ready."""
        return time.perf_counter() - self._last

    def total(self) -> float:
        return self._last - self.start

    def metrics(self) -> dict[str, float]:
        out = {f"startup/{name.replace(' ', '_')}_s": seconds for name, seconds, _ in self.laps}
        out["startup/total_s"] = self.total()
        return out

    def line(self) -> str:
        parts = [f"{name} {seconds:.2f}s" + (f" ({detail})" if detail else "") for name, seconds, detail in self.laps]
        return f"[tether] ready in {self.total():.1f}s: " + ", ".join(parts)

    def report(self) -> None:
        print(self.line(), file=sys.stderr, flush=True)
