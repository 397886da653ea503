"""The engine as a Ray actor: the embedded engine behind its serving core and HTTP server.

Rollout traffic goes over HTTP (through the router), like it would to an SGLang server; weight
buckets from the trainer arrive as Ray calls (object-store references: shared memory on one host).
"""

from __future__ import annotations

import os

from tether.engine.base import EngineBackend, node_address
from tether.engine.core import start_engine_core
from tether.engine.embedded import EmbeddedEngine
from tether.engine.server import EngineServer
from tether.http.guard import DEFAULT_LIMITS, ServerLimits
from tether.run.faults import engine_update_fault
from tether.weight_sync.base import copy_threads
from tether.weight_sync.packed import PackedBucket, unpack_bucket
from tether.weight_sync.shared_memory import SegmentReader, SharedBucket


class EngineActor(EngineBackend):
    def __init__(self, model_path: str, dtype: str = "float32", max_batch: int = 256, threads: int = 0,
                 device: str = "cpu", deterministic: bool = False, max_batch_tokens: int = 1 << 16,
                 host: str = "127.0.0.1", seed: int = 0, onednn_linear: bool = True,
                 prefix_cache_tokens: int = 0, port: int = 0, limits: ServerLimits = DEFAULT_LIMITS):
        self.core = start_engine_core(
            lambda: EmbeddedEngine(model_path, dtype, max_batch, threads, device, deterministic, onednn_linear),
            max_batch=max_batch, max_batch_tokens=max_batch_tokens, prefix_cache_tokens=prefix_cache_tokens, seed=seed)
        self.engine = self.core.engine
        self._segment = SegmentReader()  # the trainer's weight-sync segment, when it is on this host
        advertised = host
        if host == "0.0.0.0":  # listen everywhere, advertise the node's address to the router
            advertised = node_address()
        self.server = EngineServer(self.core, host=host, port=port, limits=limits).start()
        self._url = f"http://{advertised}:{self.server.port}"

    def url(self) -> str:
        return self._url

    def load_weight_bucket(self, bucket: SharedBucket | PackedBucket, version: int, overlapped: bool = False) -> int:
        """One bucket from ObjectStoreSender, copied into the model from shared memory or the object store
        (with half the threads when ``overlapped``: the trainer writes the next bucket meanwhile)."""
        engine_update_fault()
        tensors = self._segment.tensors(bucket) if isinstance(bucket, SharedBucket) else unpack_bucket(bucket)

        def load() -> int:
            with copy_threads(overlapped):
                return self.engine.load_weight_bucket(tensors, version)

        return self.core.exclusive(load)

    def commit_weights(self, version: int) -> int:
        return self.core.exclusive(lambda: self.engine.commit_weights(version))

    def release_memory(self, tags: list[str]) -> None:
        self.core.release_memory(tags)

    def resume_memory(self, tags: list[str]) -> None:
        self.core.resume_memory(tags)

    def health(self) -> dict:
        return {**self.engine.health(), **self.core.load(), "url": self._url, "pid": os.getpid(), "backend": "embedded"}

    def shutdown(self) -> None:
        self.server.stop()

