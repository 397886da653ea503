"""The interface every weight transport implements (object store, torch.distributed broadcast, disk)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

DEFAULT_BUCKET_BYTES = 256 << 20  # cluster.weight_sync_bucket_mb's default


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """(bucket, whether it is the last): consecutive groups of (name, tensor), in order, each at most
    ``bucket_bytes`` (a tensor larger than that travels alone, never split). The input is consumed
    lazily, one tensor past the bucket: that is how the last bucket is known without gathering more."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if bucket and size + nbytes(tensor) > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes(tensor)
    if bucket:
        yield bucket, True


@contextmanager
def copy_threads(overlapped: bool):
    """Torch threads for the copies of a push: half of this process's (at least one) while the other
    side copies too, all of them otherwise.

    The trainer stages bucket k+1 while the engines load bucket k, and colocated they share the cores:
    with every thread each, the two processes' thread pools fight over them and each parallel copy
    waits for a descheduled thread (on 2 cores that made a push of 64 MB buckets 2x slower)."""
    before = torch.get_num_threads()
    if overlapped:
        torch.set_num_threads(max(1, before // 2))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class WeightSender(ABC):
    """Trainer side of a transport: streams (name, full tensor) pairs to every engine."""

    device: str = "cpu"
    """Where ``send`` wants the tensors (the trainer gathers them there)."""

    @abstractmethod
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Deliver all tensors, then tell the engines the new weight version. Returns timing metrics."""

    @abstractmethod
    def close(self) -> None:
        """Free what the transport holds (a staging segment, a process group); it is not used again."""
