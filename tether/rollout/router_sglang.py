"""cluster.router: sglang_router — the sglang-router package's router (cache-aware routing, as slime
and miles use) in front of the engines, started as a process by the rollout manager.

Generation goes through it: it places each request on the engine most likely to hold its prefix
(the earlier turns of a conversation, a group's shared prompt), balancing load when none does.
Everything addressed to every engine (abort, pause, memory, health, load) still goes to the engines
directly, through tether's Router underneath, which also keeps the engines' health.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import httpx

from tether.engine.server_process import ServerProcess
from tether.http.server import free_port
from tether.rollout.router import Router, Worker

STARTUP_TIMEOUT_S = 120.0


class SglangRouterFront(Router):
    def __init__(self, urls: list[str], timeout_s: float = 600.0, policy: str = "cache_aware",
                 log_dir: str | None = None):
        super().__init__(urls, timeout_s=timeout_s)
        if importlib.util.find_spec("sglang_router") is None:
            raise RuntimeError("cluster.router: sglang_router needs the sglang-router package in tether's "
                               "environment: pip install sglang-router")
        port = free_port()
        log = Path(log_dir or tempfile.mkdtemp()) / f"sglang_router_{os.getpid()}.log"
        # Its metrics exporter takes a fixed port by default: a second router on the host would die on it.
        args = ["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--worker-urls", *[w.url for w in self.workers]]
        self.process = ServerProcess("sglang-router", args, sys.executable, {}, log, f"http://127.0.0.1:{port}/health")
        self.process.wait_healthy(STARTUP_TIMEOUT_S)
        self.front = Worker(f"http://127.0.0.1:{port}")

    def _pick(self, tokens: int) -> Worker:
        """Every generation goes to the router process, which picks the engine."""
        with self._lock:
            self.front.outstanding_requests += 1
            self.front.outstanding_tokens += tokens
            return self.front

    def generate(self, payload: dict) -> dict | list:
        parts = split_batch(payload)
        return super().generate(payload) if parts is None else [super(SglangRouterFront, self).generate(p) for p in parts]

    async def generate_async(self, client: httpx.AsyncClient, payload: dict) -> dict | list:
        """sglang-router takes one prompt per request (one sampling-parameter dict): a batch (a group's
        samples, each with its own seed) goes as one request per prompt, concurrently; the router's
        prefix tree sends them to the engine that holds their shared prompt."""
        parts = split_batch(payload)
        if parts is None:
            return await super().generate_async(client, payload)
        return list(await asyncio.gather(*(super(SglangRouterFront, self).generate_async(client, p) for p in parts)))

    def close(self) -> None:
        super().close()
        self.process.stop()


def split_batch(payload: dict) -> list[dict] | None:
    """A batched /generate payload (a list of prompts) as one payload per prompt; None if it is one."""
    key = "input_ids" if payload.get("input_ids") is not None else "text"
    prompts = payload.get(key)
    if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (list, str))):
        return None
    n = len(prompts)
    params, rids = payload.get("sampling_params") or {}, payload.get("rid")
    out = []
    for i in range(n):
        part = {**payload, key: prompts[i], "sampling_params": params[i] if isinstance(params, list) else params}
        if isinstance(rids, list):
            part["rid"] = rids[i]
        out.append(part)
    return out
