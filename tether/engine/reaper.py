"""Runs an inference server as its own child and takes the server's whole process group down with it.

    python -m tether.engine.reaper -- SERVER_PYTHON ARGS...   (started by server_process.py)

A killed engine actor must not leave a server holding its bundle's GPU. The Linux parent-death signal
reaches one process only, and a server is several: vLLM's API server starts an engine core, which
starts the workers. When the API server alone got the signal, vLLM-CPU's engine core lived on, orphaned
with its memory. So the actor starts this small process instead (standard library only), in a session
of its own; it gets the parent-death signal, and on it, or when the server exits, it signals the whole
process group: first SIGTERM, then SIGKILL to whatever is left after a grace period.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0
PR_SET_PDEATHSIG = 1


def end_group(grace_s: float = GRACE_S) -> None:
    """SIGTERM to every other process of this group, then SIGKILL to those still there after ``grace_s``."""
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's signal reaches this process too
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:  # reap what has exited, so it stops counting as a group member
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not _others_alive(pgid):
            return
        time.sleep(0.1)
    for pid in _members(pgid):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _members(pgid: int) -> list[int]:
    """The pids of this process group (from /proc; Linux, where the parent-death signal exists)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            out.append(int(entry))
    return out


def _others_alive(pgid: int) -> bool:
    return any(pid != os.getpid() for pid in _members(pgid))


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m tether.engine.reaper -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the actor's shutdown stops the group instead
        pass
    if os.getppid() == 1:  # the actor died before the signal was armed
        return 1
    server = subprocess.Popen(argv[1:])  # in this process's group: the actor started it in a new session
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        end_group()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = server.wait()
    if not stopping:  # the server exited by itself: nothing it started may outlive it
        end_group()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
