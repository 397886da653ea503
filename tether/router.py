"""The router: spreads generate requests over engine servers by least outstanding work.

It keeps, per worker, the number of requests and KV tokens it has sent and not yet had back, and
sends each request to the healthy worker with the least outstanding tokens. Workers can be added
and removed while running; a health check marks a worker down (it gets no traffic) until it answers
again; `abort_all` tells every worker to drop what is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

import httpx

from tether.http_client import engine_headers, sync_client


class NoHealthyWorker(RuntimeError):
    pass


@dataclass
class Worker:
    url: str
    healthy: bool = True
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    served: int = 0


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

    @property
    def workers(self) -> list[Worker]:
        with self._lock:
            return list(self._workers.values())

    def check_health(self, timeout_s: float = 5.0) -> dict[str, bool]:
        """GET /health on every worker; an unreachable or failing one is marked down."""
        status = {}
        for worker in self.workers:
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
            healthy = [w for w in self._workers.values() if w.healthy]
            if not healthy:
                raise NoHealthyWorker(f"no healthy engine among {list(self._workers)}")
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
    def lease(self, tokens: int) -> Iterator[str]:
        """The least-loaded healthy worker's URL, counted as ``tokens`` of outstanding work while held:
        a custom generate function sends every turn of a group to it, so later turns find the
        earlier ones in its prefix cache."""
        worker = self._pick(tokens)
        try:
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
        """``generate`` on an asyncio client: the same choice of worker and the same accounting."""
        tokens = _estimate_tokens(payload)
        worker = self._pick(tokens)
        try:
            reply = await client.post(f"{worker.url}/generate", json=payload, timeout=self.timeout_s)
        except httpx.TransportError:
            worker.healthy = False
            raise
        finally:
            self._done(worker, tokens)
        reply.raise_for_status()
        return reply.json()

    async def abort_async(self, client: httpx.AsyncClient, rids: list[str]) -> int:
        """Abort these requests on every worker (a worker that does not hold one answers 0 for it)."""
        async def one(url: str, rid: str) -> int:
            reply = await client.post(f"{url}/abort_request", json={"rid": rid}, timeout=self.timeout_s)
            reply.raise_for_status()
            return int(reply.json().get("aborted", 0))
        counts = await asyncio.gather(*(one(w.url, rid) for w in self.workers for rid in rids))
        return sum(counts)

    def broadcast(self, path: str, payload: dict | None = None) -> list[dict]:
        """POST to every worker (pause, continue, release, resume, flush, abort)."""
        out = []
        for worker in self.workers:
            reply = self._client.post(f"{worker.url}{path}", json=payload or {}, timeout=self.timeout_s)
            reply.raise_for_status()
            out.append(reply.json())
        return out

    def query(self, path: str, missing_ok: bool = False) -> list[dict]:
        """GET from every worker (load and cache counters); ``missing_ok``: a worker answering 404 (a
        backend without the endpoint) gives {}."""
        out = []
        for worker in self.workers:
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


def _estimate_tokens(payload: dict) -> int:
    """Prompt + max new tokens of a /generate payload: the KV work the request brings."""
    ids = payload.get("input_ids")
    prompts = ids if ids and isinstance(ids[0], list) else [ids or payload.get("text") or ""]
    params = payload.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    return sum(len(p) + sp.get("max_new_tokens", 128) for p, sp in zip(prompts, params))
