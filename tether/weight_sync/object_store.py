"""Weights through the Ray object store, in buckets.

Same host (colocated): the object store is shared memory, so a bucket is written once and mapped by
each engine. Across hosts Ray moves it. Buckets bound the extra memory to ``bucket_bytes`` and let
the engine load bucket k while the trainer gathers bucket k+1.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import ray
import torch

from tether.cluster import wait
from tether.weight_sync.base import WeightSender


class ObjectStoreSender(WeightSender):
    def __init__(self, engines: list[Any], bucket_bytes: int = 256 << 20, timeout_s: float = 300.0):
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s

    def _flush(self, bucket: dict[str, torch.Tensor], pending: list, index: int, version: int) -> list:
        # At most one bucket in flight besides the one being filled: bounded memory, overlapped copy.
        if pending:
            wait(pending, self.timeout_s, f"engines loading weight bucket {index - 1} (version {version})")
        ref = ray.put(bucket)
        return [e.load_weight_bucket.remote(ref, version) for e in self.engines]

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        start = time.perf_counter()
        bucket: dict[str, torch.Tensor] = {}
        size = index = total = 0
        pending: list = []
        for name, tensor in named_tensors:
            bucket[name] = tensor.contiguous()
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                pending = self._flush(bucket, pending, index, version)
                total, bucket, size, index = total + size, {}, 0, index + 1
        if bucket:
            pending = self._flush(bucket, pending, index, version)
            total, index = total + size, index + 1
        if pending:
            wait(pending, self.timeout_s, f"engines loading weight bucket {index - 1} (version {version})")
        wait([e.commit_weights.remote(version) for e in self.engines], self.timeout_s,
             f"engines committing weight version {version}")
        elapsed = time.perf_counter() - start
        return {"weight_sync/seconds": elapsed, "weight_sync/megabytes": total / 2**20, "weight_sync/buckets": float(index)}
