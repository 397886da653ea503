"""The interface every inference engine offers to rollout and weight sync.

Backends: the embedded engine (PyTorch, in a Ray actor, runs anywhere) and, on GPU clusters,
SGLang / vLLM servers behind the same methods. Memory is released and resumed by tag so that a
colocated trainer can use the device while the engine sleeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tether.engine.generate import GenerateOutput
from tether.engine.sampling import SamplingParams

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
MEMORY_TAGS = (WEIGHTS, KV_CACHE)


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    sampling: SamplingParams


class Engine(ABC):
    @abstractmethod
    def generate(self, requests: list[GenerateRequest], seed: int) -> list[GenerateOutput]:
        """One output per request, in order. ``seed`` makes sampling reproducible."""

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
        """Liveness and state: weight version, released tags, requests served."""


def check_tags(tags: list[str]) -> list[str]:
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return list(tags)
