"""Heartbeats: every serving engine is asked for a one-token generation while rollouts run.

An engine that dies answers no connection at once; one that is frozen (a stopped process, a wedged
step) holds every request until the call timeout, which is minutes. The watch asks each engine's
`/health_generate` every ``interval_s`` and marks the engine lost in the router when it does not
answer within ``timeout_s``: its requests in flight are cancelled there and sent to the others
(see EngineFleet.send), and the driver starts a replacement (RolloutHandle).

The watch runs only while a rollout or an eval generates (``watching()``): between rollouts the
engines may have their weights released, or be loading new ones, and would not answer.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import httpx

from tether.http.client import engine_headers, sync_client
from tether.rollout.router import Router


class EngineWatch:
    def __init__(self, router: Router, interval_s: float, timeout_s: float, others: list[Router] | None = None):
        """``others``: more routers whose engines are watched alike (the served models')."""
        self.router, self.interval_s, self.timeout_s = router, interval_s, timeout_s
        self.routers = [router, *(others or [])]
        self._active = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client = sync_client(timeout_s, headers=engine_headers())
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-watch")
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watching(self):
        """Heart-beat the engines while the body runs (nested and concurrent uses add up)."""
        self.set_active(True)
        try:
            yield
        finally:
            self.set_active(False)

    def set_active(self, on: bool) -> None:
        with self._lock:
            self._active += 1 if on else -1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._active > 0:
                self.check_once()

    def check_once(self) -> dict[str, str | None]:
        """One heartbeat of every serving engine, concurrently: url -> None (answered) or why not. An
        engine that fails it is marked lost."""
        owners = {w.url: router for router in self.routers for w in router.serving}
        futures = {url: self._pool.submit(self._probe, url) for url in owners}
        wait(futures.values())
        found = {url: future.result() for url, future in futures.items()}
        for url, problem in found.items():
            # Paused meanwhile (the rollout ended while the probe waited): an engine between rollouts
            # may not generate, and its silence then says nothing.
            if problem is not None and self._active > 0 and owners[url].mark_lost(url, problem):
                print(f"[tether] engine {url} lost: {problem}; its requests go to another engine (or wait for "
                      "its replacement)", file=sys.stderr, flush=True)
        return found

    def _probe(self, url: str) -> str | None:
        try:
            reply = self._client.get(f"{url}/health_generate", timeout=self.timeout_s)
        except httpx.TimeoutException:
            return f"no answer to /health_generate within {self.timeout_s:g}s (frozen)"
        except httpx.TransportError as err:
            return f"/health_generate failed: {type(err).__name__}: {err}"
        if reply.status_code == 429:  # alive, and busy: its queue is full
            return None
        if reply.status_code != 200:
            return f"/health_generate answered {reply.status_code}: {reply.text[:200]}"
        return None

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
