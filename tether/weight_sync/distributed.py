"""Weights over a torch.distributed broadcast group: trainer rank 0 is rank 0, engine i is rank i + 1.

The group is separate from the trainer's own (FSDP) group: it is built from a TCPStore that trainer
rank 0 hosts, with gloo on CPU and NCCL on GPU. Engines join and receive through their HTTP API
(`/init_weights_update_group`, `/update_weights_from_distributed`, as SGLang servers do), so the same
sender drives any engine that speaks it. Each HTTP call blocks in the engine while the trainer
broadcasts, so the calls go out on threads and the broadcasts run here; all of it has timeouts.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Iterable

import torch
from torch.distributed import TCPStore

from tether.http_client import engine_headers, sync_client
from tether.weight_sync.base import DEFAULT_BUCKET_BYTES, WeightSender, iter_buckets, nbytes

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> TCPStore:
    """A TCPStore whose master listens on ``host`` only: torch's own listens on every interface, where
    anyone who reaches the port could join the group. The master gets a socket bound here, and owns it."""
    if not is_master:
        return TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                              backlog=1024) as server:
        return TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=server.detach())


def join_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float):
    """A standalone process group (not the default one): returns the backend object to broadcast on."""
    timeout = timedelta(seconds=timeout_s)
    store = tcp_store(master_address, master_port, world_size, rank == 0, timeout)
    if backend == "nccl":
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size)
    if backend != "gloo":
        raise ValueError(f"weight-sync backend must be gloo or nccl, got {backend!r}")
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)


class JoinError(RuntimeError):
    """A refused /init_weights_update_group; ``status`` is the HTTP status servers answer with."""

    status = 500


class JoinBusy(JoinError):
    """Another join of this server is still waiting for its group."""

    status = 409  # Conflict: try again once the other join is done


class JoinFailed(JoinError):
    """The rendezvous did not form (nobody at the address, or not every member came in time)."""

    status = 504  # the members the server waited for did not come


class GroupJoiner:
    """The engine side of /init_weights_update_group: one join at a time, each given up after
    ``timeout_s``, so that calls naming a dead address cannot pile up on the server's threads."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()

    def join(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str):
        if not self._lock.acquire(blocking=False):
            raise JoinBusy("another /init_weights_update_group is in progress on this engine")
        try:
            return join_group(master_address, master_port, rank, world_size, backend, self.timeout_s)
        except Exception as err:  # the rendezvous' own error, said with what was tried
            raise JoinFailed(f"joining the weight-update group at {master_address}:{master_port} as rank {rank} "
                             f"of {world_size} failed within {self.timeout_s:.0f}s: {type(err).__name__}: {err}") from err
        finally:
            self._lock.release()


class Receiver:
    """Engine side of a weight-update group: receives each announced bucket, in order, into one buffer
    that the buckets of a push share (so a push faults in fresh memory once, not once per bucket).
    ``lock`` keeps one bucket at a time on the group; ``done`` frees the buffer after a push."""

    def __init__(self, group, device: str):
        self.group = group
        self.device = device
        self.lock = threading.Lock()
        self._buffer: torch.Tensor | None = None

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        """The tensors rank 0 broadcasts, as views of the buffer: valid until the next ``receive``."""
        types = [DTYPES[d] for d in dtypes]
        sizes = [torch.Size(shape).numel() * t.itemsize for shape, t in zip(shapes, types)]
        ends = list(itertools.accumulate(_aligned(n) for n in sizes))
        if self._buffer is None or self._buffer.numel() < (ends[-1] if ends else 0):
            self._buffer = None  # free the smaller one first
            self._buffer = torch.empty(ends[-1], dtype=torch.uint8, device=self.device)
        out = {}
        for name, dtype, shape, size, end in zip(names, types, shapes, sizes, ends):
            start = end - _aligned(size)
            tensor = self._buffer[start : start + size].view(dtype).reshape(shape) if size else \
                torch.empty(shape, dtype=dtype, device=self.device)
            self.group.broadcast(tensor, 0).wait()
            out[name] = tensor
        return out

    def done(self) -> None:
        self._buffer = None


def _aligned(n: int, align: int = 64) -> int:
    return (n + align - 1) // align * align


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class DistributedSender(WeightSender):
    def __init__(self, engine_urls: list[str], master_address: str, backend: str = "gloo",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0, device: str = "cpu"):
        self.urls = engine_urls
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.device = device
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(engine_urls)), thread_name_prefix="weights")
        self._client = sync_client(timeout_s, headers=engine_headers())
        port = free_port()
        world = len(engine_urls) + 1
        body = {"master_address": master_address, "master_port": port, "world_size": world,
                "group_name": "tether-weights", "backend": backend}
        calls = [self._pool.submit(self._post, url, "/init_weights_update_group", {**body, "rank_offset": i + 1})
                 for i, url in enumerate(engine_urls)]
        self.group = join_group(master_address, port, 0, world, backend, timeout_s)
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
        except TimeoutError:
            raise TimeoutError(f"timed out after {self.timeout_s:.0f}s waiting for {what}") from None

    def _bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int | None) -> float:
        """One bucket: announce it over HTTP, broadcast it, wait for every engine to load it; returns
        the seconds spent broadcasting."""
        body = {"names": [n for n, _ in bucket], "dtypes": [DTYPE_NAMES[t.dtype] for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": "tether-weights",
                "weight_version": None if version is None else str(version)}  # SGLang types it as a string
        calls = [self._pool.submit(self._post, url, "/update_weights_from_distributed", body) for url in self.urls]
        start = time.perf_counter()
        for _, tensor in bucket:
            self.group.broadcast(tensor.to(self.device).contiguous(), 0).wait()
        elapsed = time.perf_counter() - start
        self._wait(calls, f"engines confirming a weight bucket of {len(bucket)} tensors")
        return elapsed

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
