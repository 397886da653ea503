"""The start-up clock: laps in order, the process's own start counted, one printed line."""

from __future__ import annotations

import time

from tether.tracking.startup import StartupClock, process_age_s

_IMPORTED = time.time()


def test_process_age_is_this_interpreters_lifetime():
    age = process_age_s()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    # The process started before this module was imported (however long the suite has run since) and
    # after the machine booted; the clock tick's resolution is 10 ms.
    assert age is not None and time.time() - _IMPORTED - 0.02 <= age <= uptime + 0.02


def test_laps_add_up_to_the_total_and_print_on_one_line():
    clock = StartupClock()
    time.sleep(0.02)
    clock.lap("ray")
    time.sleep(0.01)
    assert clock.since_last() >= 0.01
    clock.lap("actors", "engines 0.0s, trainer 0.0s")
    names = [name for name, _, _ in clock.laps]
    assert names == ["imports", "ray", "actors"]
    assert abs(sum(s for _, s, _ in clock.laps) - clock.total()) < 1e-6
    assert clock.laps[1][1] >= 0.02
    metrics = clock.metrics()
    assert set(metrics) == {"startup/imports_s", "startup/ray_s", "startup/actors_s", "startup/total_s"}
    line = clock.line()
    assert line.startswith(f"[tether] ready in {clock.total():.1f}s: imports ") and "\n" not in line
    assert "actors " in line and "(engines 0.0s, trainer 0.0s)" in line


def test_without_the_process_the_clock_starts_at_creation():
    clock = StartupClock(count_process=False)
    clock.lap("only")
    assert [name for name, _, _ in clock.laps] == ["only"] and clock.total() < 1.0
