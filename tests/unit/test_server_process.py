"""An inference server started by an engine actor (tether/engine/server_process.py, reaper.py): a server
is several processes (vLLM's API server starts an engine core, which starts workers), and none of them
may outlive the actor, killed or not, nor the server itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A stand-in server: starts a child of its own (as vLLM's API server starts its engine core), writes
# both pids, then sleeps; with "exit" as its second argument it exits at once, leaving the child.
SERVER = ("import os, subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
          "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getpid()} {child.pid}')\n"
          "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
          "time.sleep(0.5 if sys.argv[2] == 'exit' else 600)\n")
ACTOR = ("import sys, time\n"
         "from pathlib import Path\n"
         "from tether.engine.server_process import ServerProcess\n"
         "ServerProcess('stand-in server', ['-c', sys.argv[1], sys.argv[2], sys.argv[3]], None, {}, Path(sys.argv[4]),\n"
         "              'http://127.0.0.1:9/health')\n"
         "time.sleep(600)\n")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def pids_of(path: Path, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, "the stand-in server never started"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def start_actor(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    pids = tmp_path / f"pids_{mode}"
    actor = subprocess.Popen([sys.executable, "-c", ACTOR, SERVER, str(pids), mode, str(tmp_path / f"{mode}.log")],
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    return actor, pids_of(pids)


def test_a_killed_actor_takes_its_servers_every_process_down(tmp_path):
    actor, (server, child) = start_actor(tmp_path, "serve")
    assert alive(server) and alive(child)
    actor.kill()  # SIGKILL: no shutdown runs in the actor
    actor.wait(timeout=10)
    assert gone([server, child]), f"left running: {[p for p in (server, child) if alive(p)]}"


def test_a_server_that_exits_leaves_nothing_behind(tmp_path):
    actor, (server, child) = start_actor(tmp_path, "exit")
    try:
        assert gone([server, child]), f"left running: {[p for p in (server, child) if alive(p)]}"
    finally:
        actor.kill()
        actor.wait(timeout=10)


def test_stop_ends_the_server_and_its_children(tmp_path):
    from tether.engine.server_process import ServerProcess

    pids = tmp_path / "pids_stop"
    server = ServerProcess("stand-in server", ["-c", SERVER, str(pids), "serve"], None, {}, tmp_path / "stop.log",
                           "http://127.0.0.1:9/health")
    found = pids_of(pids)
    server.stop(grace_s=10)
    assert not server.alive() and gone(found)
    assert "$ " in (tmp_path / "stop.log").read_text()  # the command heads the log
