"""The router: spreads generate requests over engine servers by least outstanding work.

It keeps, per worker, the number of requests and KV tokens it has sent and not yet had back, and
sends each request to the healthy worker with the least outstanding tokens. Workers can be added
and removed while running; a health check marks a worker down (it gets no traffic) until it answers
again; `abort_all` tells every worker to drop what is in flight.

A worker found dead or frozen is marked lost (`mark_lost`): it gets no more traffic, and every
asyncio request waiting on it is cancelled at once and raises `EngineLost`, so that its caller can
send the same request to another worker. With no worker left, an asyncio request waits for one to
be added (a replacement), up to the router's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import httpx

from tether.http.client import engine_headers, sync_client


class NoHealthyWorker(RuntimeError):
    pass


class EngineLost(ConnectionError):
    """The worker serving a request was marked lost while the request was in flight."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"engine {url} was lost: {reason}")
        self.url, self.reason = url, reason


@dataclass
class Worker:
    url: str
    healthy: bool = True
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    served: int = 0
    lost: str | None = None
    """Why the worker was taken out for good (dead or frozen); None while it serves."""
    waiting: set = field(default_factory=set)
    """(event loop, task) of the asyncio requests in flight on it: cancelled when it is lost."""


class Router:
    def __init__(self, urls: list[str] | None = None, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self._workers: dict[str, Worker] = {}
        self._lock = threading.Lock()
        self._client = sync_client(timeout_s, headers=engine_headers())
        for url in urls or []:
            self.add_worker(url)

    # ------------------------------------------------------------ membership and health
    def add_worker(self, url: str) -> None:
        with self._lock:
            self._workers.setdefault(url.rstrip("/"), Worker(url.rstrip("/")))

    def remove_worker(self, url: str) -> None:
        with self._lock:
            self._workers.pop(url.rstrip("/"), None)

    def mark_lost(self, url: str, reason: str) -> bool:
        """Take the worker out for good and cancel the asyncio requests waiting on it (each raises
        EngineLost). False when it was lost already (or is not a worker here)."""
        with self._lock:
            worker = self._workers.get(url.rstrip("/"))
            if worker is None or worker.lost is not None:
                return False
            worker.lost, worker.healthy = reason, False
            waiting = list(worker.waiting)
        for loop, task in waiting:
            loop.call_soon_threadsafe(self._cancel_if_waiting, worker, (loop, task))
        return True

    def _cancel_if_waiting(self, worker: Worker, entry: tuple) -> None:
        # In the request's own event loop: a request that left ``bound`` meanwhile is not cancelled.
        if entry in worker.waiting:
            entry[1].cancel(LOST)

    def lost(self) -> dict[str, str]:
        """URL -> reason of every worker taken out and not yet removed."""
        return {w.url: w.lost for w in self.workers if w.lost is not None}

    @property
    def workers(self) -> list[Worker]:
        with self._lock:
            return list(self._workers.values())

    @property
    def serving(self) -> list[Worker]:
        """The workers not lost: the ones broadcasts and queries go to."""
        return [w for w in self.workers if w.lost is None]

    def check_health(self, timeout_s: float = 5.0) -> dict[str, bool]:
        """GET /health on every worker; an unreachable or failing one is marked down."""
        status = {}
        for worker in self.workers:
            if worker.lost is not None:
                status[worker.url] = False
                continue
            try:
                ok = self._client.get(f"{worker.url}/health", timeout=timeout_s).status_code == 200
            except httpx.HTTPError:
                ok = False
            worker.healthy = ok
            status[worker.url] = ok
        return status

    # ------------------------------------------------------------ traffic
    def _pick(self, tokens: int) -> Worker:
        with self._lock:
            healthy = [w for w in self._workers.values() if w.healthy and w.lost is None]
            if not healthy:
                lost = {w.url: w.lost for w in self._workers.values() if w.lost}
                raise NoHealthyWorker(f"no healthy engine among {list(self._workers)}"
                                      + (f" (lost: {lost})" if lost else ""))
            worker = min(healthy, key=lambda w: (w.outstanding_tokens, w.outstanding_requests))
            worker.outstanding_requests += 1
            worker.outstanding_tokens += tokens
            return worker

    def _done(self, worker: Worker, tokens: int) -> None:
        with self._lock:
            worker.outstanding_requests -= 1
            worker.outstanding_tokens -= tokens
            worker.served += 1

    @contextlib.contextmanager
    def lease(self, tokens: int):
        """The least-loaded healthy worker's URL, counted as ``tokens`` of outstanding work while held
        (for a sync caller: no waiting for a worker, NoHealthyWorker when none is up)."""
        worker = self._pick(tokens)
        try:
            yield worker.url
        finally:
            self._done(worker, tokens)

    @contextlib.asynccontextmanager
    async def lease_async(self, tokens: int):
        """The least-loaded healthy worker's URL, counted as ``tokens`` of outstanding work while held:
        a custom generate function sends every turn of a group to it, so later turns find the
        earlier ones in its prefix cache. Waits for a worker while none is up; the body is
        cancelled, raising EngineLost, when the worker is lost meanwhile."""
        worker = await self.pick_async(tokens)
        try:
            async with self.bound(worker):
                yield worker.url
        finally:
            self._done(worker, tokens)

    def generate(self, payload: dict) -> dict | list:
        """POST /generate to the least-loaded worker; raises httpx.HTTPStatusError on a 4xx/5xx."""
        tokens = _estimate_tokens(payload)
        worker = self._pick(tokens)
        try:
            reply = self._client.post(f"{worker.url}/generate", json=payload, timeout=self.timeout_s)
        except httpx.TransportError:
            worker.healthy = False  # unreachable: no more traffic until a health check says otherwise
            raise
        finally:
            self._done(worker, tokens)
        reply.raise_for_status()
        return reply.json()

    async def generate_async(self, client: httpx.AsyncClient, payload: dict) -> dict | list:
        """``generate`` on an asyncio client: the same choice of worker and the same accounting. Waits
        for a worker while none is up (an engine being replaced); raises EngineLost when its worker is
        lost meanwhile, and marks a worker it cannot reach lost."""
        tokens = _estimate_tokens(payload)
        worker = await self.pick_async(tokens)
        try:
            async with self.bound(worker):
                reply = await client.post(f"{worker.url}/generate", json=payload, timeout=self.timeout_s)
        except (httpx.TransportError, EngineLost) as err:
            if not isinstance(err, httpx.TimeoutException):  # refused or cut: the server is gone
                self.mark_lost(worker.url, f"{type(err).__name__}: {err}")
            raise
        finally:
            self._done(worker, tokens)
        reply.raise_for_status()
        return reply.json()

    async def pick_async(self, tokens: int, poll_s: float = 0.2) -> Worker:
        """``_pick``, waiting up to the timeout while every worker is lost (until a replacement is added)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._pick(tokens)
            except NoHealthyWorker as err:
                if not any(w.lost for w in self.workers) or time.monotonic() > deadline:
                    raise NoHealthyWorker(f"{err}; waited {self.timeout_s:.0f}s for a replacement") from None
            await asyncio.sleep(poll_s)

    @contextlib.asynccontextmanager
    async def bound(self, worker: Worker):
        """Run the body as work on ``worker``: when the worker is lost meanwhile, the body is cancelled
        and EngineLost raised in its place."""
        task = asyncio.current_task()
        entry = (asyncio.get_running_loop(), task)
        with self._lock:
            if worker.lost is not None:
                raise EngineLost(worker.url, worker.lost)
            worker.waiting.add(entry)
        try:
            yield
        except asyncio.CancelledError as err:
            if worker.lost is None or LOST not in err.args:
                raise
            task.uncancel()  # our cancellation, turned into an error the caller handles
            raise EngineLost(worker.url, worker.lost) from None
        finally:
            with self._lock:
                worker.waiting.discard(entry)

    async def abort_async(self, client: httpx.AsyncClient, rids: list[str]) -> int:
        """Abort these requests on every worker (a worker that does not hold one answers 0 for it)."""
        async def one(url: str, rid: str) -> int:
            reply = await client.post(f"{url}/abort_request", json={"rid": rid}, timeout=self.timeout_s)
            reply.raise_for_status()
            return int(reply.json().get("aborted", 0))
        counts = await asyncio.gather(*(one(w.url, rid) for w in self.serving for rid in rids))
        return sum(counts)

    def broadcast(self, path: str, payload: dict | None = None) -> list[dict]:
        """POST to every worker (pause, continue, release, resume, flush, abort)."""
        out = []
        for worker in self.serving:
            reply = self._client.post(f"{worker.url}{path}", json=payload or {}, timeout=self.timeout_s)
            reply.raise_for_status()
            out.append(reply.json())
        return out

    def query(self, path: str, missing_ok: bool = False) -> list[dict]:
        """GET from every worker (load and cache counters); ``missing_ok``: a worker answering 404 (a
        backend without the endpoint) gives {}."""
        out: list[dict] = []
        for worker in self.serving:
            try:
                reply = self._client.get(f"{worker.url}{path}", timeout=self.timeout_s)
            except httpx.TransportError as err:
                raise ConnectionError(f"lost the connection to {worker.url} asking for {path} ({err!r})") from None
            if missing_ok and reply.status_code == 404:
                out.append({})
                continue
            reply.raise_for_status()
            out.append(reply.json())
        return out

    def abort_all(self) -> int:
        return sum(r.get("aborted", 0) for r in self.broadcast("/abort_request", {"abort_all": True}))

    def close(self) -> None:
        self._client.close()


LOST = "tether: engine lost"
"""The message of the cancellations ``mark_lost`` sends, told apart from any other cancellation."""


def _estimate_tokens(payload: dict) -> int:
    """Prompt + max new tokens of a /generate payload: the KV work the request brings."""
    ids = payload.get("input_ids")
    prompts = ids if ids and isinstance(ids[0], list) else [ids or payload.get("text") or ""]
    params = payload.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    return sum(len(p) + sp.get("max_new_tokens", 128) for p, sp in zip(prompts, params))
