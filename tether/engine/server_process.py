"""An inference server (vLLM, SGLang) as a child process of its engine actor: started with its own
Python, logged to a file, waited for with a timeout, and stopped with the actor.

A killed actor must not leave a server holding the bundle's GPU, and a server is several processes
(vLLM's API server starts an engine core, which starts workers). So the server runs under a small
reaper (reaper.py) in a session of its own: the reaper gets SIGTERM when the actor dies (Linux
parent-death signal) and ends the whole process group, as it does when the server exits by itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tether.http.client import sync_client

from tether.errors import EngineStartError

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the actor's shutdown (or the session's end) stops the server instead
        pass


class ServerProcess:
    def __init__(self, what: str, args: list[str], python: str | None, env: dict[str, str], log_path: Path,
                 health_url: str):
        self.what, self.health_url, self.log_path = what, health_url, log_path
        self.command = [python or sys.executable, *args]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self._log.write(f"$ {' '.join(self.command)}\n".encode())
        self._log.flush()
        reaped = [sys.executable, "-m", "tether.engine.reaper", "--", *self.command]
        self.proc = subprocess.Popen(reaped, env={**os.environ, **env}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_bytes()[-16384:].decode(errors="replace")
        except OSError as err:
            return f"(no log: {err})"
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until the server answered its health URL with 200; raises EngineStartError naming the
        server, its command and the last lines of its log when it exits first or takes longer."""
        start = time.monotonic()
        with sync_client(5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise self._failed(f"exited with code {code} before it was ready")
                try:
                    if client.get(self.health_url).status_code == 200:
                        return time.monotonic() - start
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() - start > timeout_s:
                    raise self._failed(f"did not answer {self.health_url} within {timeout_s:.0f}s")
                time.sleep(0.5)

    def _failed(self, why: str) -> EngineStartError:
        return EngineStartError(f"{self.what} {why}.\ncommand: {' '.join(self.command)}\nlog {self.log_path} "
                                f"ends with:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=grace_s)
        self._log.close()
