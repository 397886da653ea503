"""The engine contract: what rollout and weight sync need from an inference engine, whatever runs it.

An engine is two things:

1. An HTTP server speaking SGLang's API (the payloads in protocol.py). Rollout, eval, the router and
   the distributed weight transport use only these routes, so any server that speaks them can serve
   a run (``HTTP_CONTRACT`` below; tests/integration/test_engine_contract.py checks every backend).
2. A Ray actor on the engine's placement-group bundle that starts that server, reports health once
   it is ready, takes weight buckets from the trainer's object-store transport and stops the server
   (``EngineBackend``). Backends: ``EngineActor`` (the embedded engine, actor.py), ``VllmEngineActor``
   (vllm.py) and ``SglangEngineActor`` (sglang.py); engine.backend picks one (backends.py).

Memory is released and resumed by tag so that a colocated trainer can use the device while the
engine sleeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
MEMORY_TAGS = (WEIGHTS, KV_CACHE)

HTTP_CONTRACT = {
    "POST /generate": "input_ids (one prompt or a list), sampling_params (one or one per prompt), rid, "
                      "return_logprob -> output_ids, meta_info {id, finish_reason {type: stop|length|abort}, "
                      "output_token_logprobs [[logprob, token, None]], weight_version, weight_version_spans "
                      "when a request ran under several versions}",
    "GET /health": "200 once the server can take requests",
    "GET /health_generate": "200 once a one-token generation went through",
    "GET /get_model_info": "{model_path, weight_version}",
    "GET /get_load": "load and counters (optional fields)",
    "POST /abort_request": "{rid} or {abort_all: true}: the aborted requests answer with their partial output",
    "POST /pause_generation": "{mode: in_place}: running requests hold (their KV kept) until /continue_generation {}",
    "POST /continue_generation": "held requests go on",
    "POST /release_memory_occupation": "{tags}: free weights and/or KV cache",
    "POST /resume_memory_occupation": "{tags}: reallocate them (released weights come back with the next push)",
    "POST /update_weights_from_tensor": "{serialized_named_tensors: base64 safetensors, weight_version}",
    "POST /init_weights_update_group": "join the trainer's broadcast group (gloo or NCCL)",
    "POST /update_weights_from_distributed": "{names, dtypes, shapes, weight_version on the last bucket}",
    "POST /flush_cache": "drop cached prefixes",
}


class Engine(ABC):
    """The embedded engine's model side (embedded.py), driven by its serving core (core.py)."""

    @abstractmethod
    def load_weight_bucket(self, tensors: dict[str, torch.Tensor], version: int) -> int:
        """Copy some named tensors into the model; returns how many were loaded."""

    @abstractmethod
    def commit_weights(self, version: int) -> int:
        """All buckets of ``version`` are in: serve with them from now on."""

    @abstractmethod
    def release_memory(self, tags: list[str]) -> None:
        """Free the memory of the tagged parts (weights, kv_cache)."""

    @abstractmethod
    def resume_memory(self, tags: list[str]) -> None:
        """Reallocate the tagged parts (released weights must be pushed again before generating)."""

    @abstractmethod
    def health(self) -> dict:
        """Liveness and state: weight version, released tags."""


class EngineBackend(ABC):
    """The actor side of an engine. The constructor starts the server on the actor's bundle and may
    return before it is ready; ``health`` answers once it is (RolloutHandle waits for it with the call
    timeout and reports the engines that did not come up)."""

    @abstractmethod
    def url(self) -> str:
        """Where the server speaking ``HTTP_CONTRACT`` listens (the router's address for it)."""

    @abstractmethod
    def health(self) -> dict:
        """Blocks until the server is ready (raising, with its log's last lines, if it cannot be); then
        {"url", "pid" (the process Ray watches), "weight_version", ...}."""

    @abstractmethod
    def load_weight_bucket(self, bucket: Any, version: int, overlapped: bool = False) -> int:
        """One bucket from the object-store transport (a SharedBucket in this host's shared memory, or a
        PackedBucket from the object store); returns the tensors held or loaded."""

    @abstractmethod
    def commit_weights(self, version: int) -> int:
        """Every bucket of ``version`` is in: serve with them (and label new tokens ``version``)."""

    @abstractmethod
    def release_memory(self, tags: list[str]) -> None: ...

    @abstractmethod
    def resume_memory(self, tags: list[str]) -> None: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the server (and any process it started)."""

    def node_id(self) -> str:
        """The Ray node this engine runs on (weight sync uses shared memory with a trainer on the same one)."""
        import ray

        return ray.get_runtime_context().get_node_id()


def node_address() -> str:
    """This machine's address for others to reach a server listening on 0.0.0.0: the Ray node's
    inside a Ray actor, else the one the default route leaves from."""
    import socket

    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def check_tags(tags: list[str]) -> list[str]:
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return list(tags)
