"""Weights from the trainer into engine actors in buckets: shared memory on the trainer's host, the Ray
object store across hosts.

An engine on the trainer's host reads each bucket from a shared-memory segment the sender keeps
between pushes (shared_memory.py): one copy in, one copy out, no page faults after the first push.
An engine on another host gets the bucket through Ray's object store, as raw bytes in numpy arrays
(with each tensor's name, dtype and shape), not as torch tensors: Ray stores numpy arrays out of
band and hands the engine views of its memory, where a pickled tensor would be copied through
``torch.save`` on put and again through ``torch.load`` on get. Either way the trainer writes bucket
k+1 while the engines load bucket k, and at most two buckets are staged at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

import ray
import torch

from tether.cluster import wait
from tether.weight_sync.base import DEFAULT_BUCKET_BYTES, WeightSender, iter_buckets, nbytes
from tether.weight_sync.packed import pack_bucket
from tether.weight_sync.shared_memory import SharedBucket, StagingSegment, bucket_span

log = logging.getLogger(__name__)

class ObjectStoreSender(WeightSender):
    def __init__(self, engines: list[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0,
                 shared_memory: bool = True):
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.shared_memory = shared_memory  # off: every engine reads from the object store
        self._local: list[bool] | None = None  # per engine: on this host
        self._segment: StagingSegment | None = None

    def _engines_here(self) -> list[bool]:
        if self._local is None:
            here = ray.get_runtime_context().get_node_id()
            nodes = wait([e.node_id.remote() for e in self.engines], self.timeout_s, "engine node ids")
            self._local = [self.shared_memory and node == here for node in nodes]
        return self._local

    def _stage(self, slot: int, bucket: list[tuple[str, torch.Tensor]], pending: list, what: str) -> SharedBucket | None:
        """Write the bucket into the segment's slot for the engines on this host. A bucket larger than
        a slot replaces the segment (after the loads in flight, which read the old one). None: no
        shared memory (no room for it: from then on the object store carries every bucket)."""
        span = bucket_span(bucket)
        if self._segment is None or span > self._segment.slot_bytes:
            if pending:
                wait(pending, self.timeout_s, what)
                pending.clear()
            if self._segment is not None:
                self._segment.close()
                self._segment = None
            try:
                self._segment = StagingSegment(span)
            except (MemoryError, OSError) as err:
                log.warning("weight sync falls back to the Ray object store: %s", err)
                self._local = [False] * len(self.engines)
                return None
        return self._segment.write(slot, bucket, overlapped=bool(pending))

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        start = time.perf_counter()
        stage_s = wait_s = 0.0
        total = buckets = 0
        pending: list = []
        for index, (bucket, last) in enumerate(iter_buckets(named_tensors, self.bucket_bytes)):
            what = f"engines loading weight bucket {index - 1} (version {version})"
            t0 = time.perf_counter()
            # Bucket k goes into slot k % 2 (and/or the store) while the engines still load bucket k-1.
            shared = self._stage(index % 2, bucket, pending, what) if any(self._engines_here()) else None
            local = self._engines_here()
            ref = ray.put(pack_bucket(bucket)) if not all(local) else None
            t1 = time.perf_counter()
            if pending:
                wait(pending, self.timeout_s, what)
            wait_s += time.perf_counter() - t1
            stage_s += t1 - t0
            # The engines' copies overlap the trainer's next write, except for the last bucket.
            pending = [e.load_weight_bucket.remote(shared if here else ref, version, here and not last)
                       for e, here in zip(self.engines, local)]
            total, buckets = total + sum(nbytes(t) for _, t in bucket), buckets + 1
        t1 = time.perf_counter()
        if pending:
            wait(pending, self.timeout_s, f"engines loading weight bucket {buckets - 1} (version {version})")
        if self._segment is not None:
            self._segment.unlink()  # every engine here has it mapped now
        wait([e.commit_weights.remote(version) for e in self.engines], self.timeout_s,
             f"engines committing weight version {version}")
        wait_s += time.perf_counter() - t1
        return {"weight_sync/seconds": time.perf_counter() - start, "weight_sync/megabytes": total / 2**20,
                "weight_sync/buckets": float(buckets), "weight_sync/stage_seconds": stage_s,
                "weight_sync/wait_seconds": wait_s}
