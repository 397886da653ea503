"""Weights over a torch.distributed broadcast group: trainer rank 0 is rank 0, engine i's workers
follow (rank 1 + i * ranks_per_engine + their tensor-parallel rank).

The group is separate from the trainer's own (FSDP) group: it is built from a TCPStore that trainer
rank 0 hosts, with gloo on CPU and NCCL on GPU, the way SGLang builds its side (group.py). Engines
join and receive through their HTTP API (`/init_weights_update_group`,
`/update_weights_from_distributed`, as SGLang servers do), so the same sender drives any engine that
speaks it. Each HTTP call blocks in the engine while the trainer broadcasts, so the calls go out on
threads and the broadcasts run here; all of it has timeouts.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from tether.http.client import engine_headers, sync_client
from tether.weight_sync.base import DEFAULT_BUCKET_BYTES, WeightSender, iter_buckets, nbytes
from tether.weight_sync.group import DTYPE_NAMES, join_group, leave_group
from tether.errors import TIMEOUTS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class DistributedSender(WeightSender):
    """``ranks_per_engine``: the group members each engine brings (its tensor-parallel size: every
    GPU worker of an SGLang or vLLM engine joins as rank_offset + its TP rank)."""

    def __init__(self, engine_urls: list[str], master_address: str, backend: str = "gloo",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0, device: str = "cpu",
                 ranks_per_engine: int = 1):
        self.urls = engine_urls
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.device = device
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(engine_urls)), thread_name_prefix="weights")
        self._client = sync_client(timeout_s, headers=engine_headers())
        port = free_port()
        world = len(engine_urls) * ranks_per_engine + 1
        # A name per group: a process cannot hold two groups of one name, and a sender is built again
        # (a new group) after an engine is replaced.
        self.group_name = f"tether-weights-{port}"
        body = {"master_address": master_address, "master_port": port, "world_size": world,
                "group_name": self.group_name, "backend": backend}
        calls = [self._pool.submit(self._post, url, "/init_weights_update_group",
                                   {**body, "rank_offset": 1 + i * ranks_per_engine})
                 for i, url in enumerate(engine_urls)]
        self.group = join_group(master_address, port, 0, world, backend, timeout_s, self.group_name)
        self._wait(calls, "engines joining the weight-sync group")

    def _post(self, url: str, path: str, body: dict) -> dict:
        reply = self._client.post(f"{url}{path}", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"{url}{path} answered {reply.status_code}: {reply.text}")
        return reply.json()

    def _wait(self, calls: list, what: str) -> None:
        try:
            for call in calls:
                call.result(timeout=self.timeout_s)
        except TIMEOUTS:
            raise TimeoutError(f"timed out after {self.timeout_s:.0f}s waiting for {what}") from None

    def _bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int | None) -> float:
        """One bucket: announce it over HTTP, broadcast it, wait for every engine to load it; returns
        the seconds spent broadcasting."""
        body = {"names": [n for n, _ in bucket], "dtypes": [DTYPE_NAMES[t.dtype] for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                "weight_version": None if version is None else str(version)}  # SGLang types it as a string
        calls = [self._pool.submit(self._post, url, "/update_weights_from_distributed", body) for url in self.urls]
        start = time.perf_counter()
        for _, tensor in bucket:
            self.group.broadcast(tensor.to(self.device).contiguous(), 0).wait()
        elapsed = time.perf_counter() - start
        self._wait(calls, f"engines confirming a weight bucket of {len(bucket)} tensors")
        return elapsed

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._client.close()
        leave_group(self.group)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        start = time.perf_counter()
        total = buckets = 0
        broadcast_s = 0.0
        for bucket, last in iter_buckets(named_tensors, self.bucket_bytes):
            broadcast_s += self._bucket(bucket, version if last else None)  # the last one commits the version
            buckets, total = buckets + 1, total + sum(nbytes(t) for _, t in bucket)
        if not buckets:
            broadcast_s += self._bucket([], version)  # no tensors: still commit the version
        elapsed = time.perf_counter() - start
        return {"weight_sync/seconds": elapsed, "weight_sync/megabytes": total / 2**20,
                "weight_sync/buckets": float(buckets), "weight_sync/broadcast_seconds": broadcast_s,
                "weight_sync/wait_seconds": elapsed - broadcast_s}
