"""The interface every weight transport implements (object store, torch.distributed broadcast, disk)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable, Iterator

import torch

DEFAULT_BUCKET_BYTES = 256 << 20  # cluster.weight_sync_bucket_mb's default


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of (name, tensor), in order, each at most ``bucket_bytes`` (a tensor larger
    than that travels alone, never split). The input is consumed lazily: one bucket at a time is held."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if bucket and size + nbytes(tensor) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes(tensor)
    if bucket:
        yield bucket


class WeightSender(ABC):
    """Trainer side of a transport: streams (name, full tensor) pairs to every engine."""

    @abstractmethod
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Deliver all tensors, then tell the engines the new weight version. Returns timing metrics."""
