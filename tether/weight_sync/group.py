"""The weight-update group: a torch.distributed process group of its own between the trainer's rank 0
(rank 0 of the group) and the engines, built exactly as SGLang builds its side.

SGLang's /init_weights_update_group (and slime, OpenRLHF and verl on the trainer side) join through a
TCP rendezvous, wrap the store in ``PrefixStore(group_name)`` and make the group with torch's
``_new_process_group_helper`` under that name; torch adds its own key prefixes inside the helper, so a
member that built its group any other way (a bare backend on the store) would wait on keys nobody
writes. Every member here, the trainer, the embedded engine and the workers inside a vLLM engine, uses
``join_group`` below, so a tether trainer can drive an SGLang server's group and the reverse. Both sides
need torch versions that prefix the same way (as slime and SGLang do).

Imports only the standard library and torch: vLLM's worker processes run this module in vLLM's own
environment.
"""

from __future__ import annotations

import itertools
import socket
import threading
from datetime import timedelta
from typing import Callable, cast

import torch
import torch.distributed.distributed_c10d as c10d
from torch.distributed import PrefixStore, TCPStore

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
BACKENDS = ("gloo", "nccl")


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> TCPStore:
    """A TCPStore whose master listens on ``host`` only: torch's own listens on every interface, where
    anyone who reaches the port could join the group. The master gets a socket bound here, and owns it."""
    if not is_master:
        return TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                              backlog=1024) as server:
        return TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=server.detach())


def join_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
               timeout_s: float, group_name: str):
    """Join (rank 0: host) the named group; returns the process group to broadcast on. Blocks until all
    ``world_size`` members have come, at most ``timeout_s``."""
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync backend must be one of {BACKENDS}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store = PrefixStore(group_name, tcp_store(master_address, master_port, world_size, rank == 0, timeout))
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=cast("c10d.GroupName", group_name), timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group ranks are global ranks
    return group


def leave_group(group) -> None:
    """Forget a group (its name can be joined again); the other members are not waited for."""
    torch.distributed.destroy_process_group(group)


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

    def join(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
             group_name: str, how: Callable[..., object] = join_group):
        """``how(master_address, master_port, rank, world_size, backend, timeout_s, group_name)`` joins
        (default: this process joins; the vLLM backend's joins its workers)."""
        if not self._lock.acquire(blocking=False):
            raise JoinBusy("another /init_weights_update_group is in progress on this engine")
        try:
            return how(master_address, master_port, rank, world_size, backend, self.timeout_s, group_name)
        except Exception as err:  # the rendezvous' own error, said with what was tried
            raise JoinFailed(f"joining the weight-update group {group_name!r} at {master_address}:{master_port} as "
                             f"rank {rank} of {world_size} failed within {self.timeout_s:.0f}s: "
                             f"{type(err).__name__}: {err}") from err
        finally:
            self._lock.release()


class Receiver:
    """Engine side of a weight-update group: receives each announced bucket, in order, into one buffer
    that the buckets of a push share (so a push faults in fresh memory once, not once per bucket).
    ``lock`` keeps one bucket at a time on the group; ``done`` frees the buffer after a push."""

    def __init__(self, group, device: str | torch.device):
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

    def close(self) -> None:
        self.done()
        leave_group(self.group)


def _aligned(n: int, align: int = 64) -> int:
    return (n + align - 1) // align * align
