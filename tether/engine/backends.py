"""The backend registry: one descriptor per ``engine.backend`` (its config class, its actor and the
actor's constructor arguments, how long it may take to start, how many weight-update ranks an engine
brings). Everything else asks the descriptor, never the backend's name. The actors implement
base.EngineBackend and their servers speak base.HTTP_CONTRACT. Adding a backend: its config class in
config.py (and the EngineConfig union), its actor module, and one entry here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from tether.config.base import Section
from tether.engine.config import EmbeddedEngineConfig, ExternalEnginesConfig, SglangConfig, VllmConfig
from tether.http.guard import ServerLimits, api_key_from_env

if TYPE_CHECKING:
    from tether.config import TetherConfig

EngineSpec = tuple[type, dict[str, Any]]  # (actor class, constructor keyword arguments)

# What a LoRA run pushes. Every engine loaded the base from model.path and no step changes it, so:
LAYERS = "layers"    # the adapted layers' merged weights only (an engine that takes some weights)
ADAPTER = "adapter"  # the adapters themselves, in PEFT's names (an engine serving them as a LoRA)
WHOLE = "whole"      # the whole merged model: vLLM's in-place reload completes whole layers only (q, k
                     # and v of a fused qkv_proj), and servers tether did not start are not assumed to
                     # take less
LORA_PUSHES = (LAYERS, ADAPTER, WHOLE)


@dataclass(frozen=True)
class Backend:
    config: type[Section]
    """The engine: section's class for this backend."""
    actor: str | None
    """'module:Class' of the engine actor (imported when engines start); None: tether starts nothing."""
    arguments: Callable[[TetherConfig, str, int], dict[str, Any]] | None = None
    """(config, device, torch threads) -> the actor's constructor keyword arguments."""
    startup_timeout_s: Callable[[Any], float] = lambda engine: 0.0
    """The backend's own start-up limit (a server's first start may compile kernels)."""
    ranks: Callable[[Any], int] = lambda engine: 1
    """Members each engine brings to the weight-update group: one per tensor-parallel worker."""
    lora_push: Callable[[Any], str] = lambda engine: LAYERS
    """What a LoRA run's pushes carry (one of LORA_PUSHES), from the engine: section."""
    adapter_field: str | None = None
    """The request field that names the adapter an engine serves the policy as (SGLang's ``lora_path``),
    set by the rollout on every /generate; None: the engine names it itself (vLLM's adapter) or serves
    no adapter."""


def server_limits(cfg: TetherConfig) -> ServerLimits:
    """What the engines' HTTP servers enforce (tether/http/guard.py), from cluster.api_key and server:."""
    s = cfg.server
    return ServerLimits(api_key=cfg.cluster.api_key or api_key_from_env(), require_key_for_generate=s.require_key_for_generate,
                        max_body_bytes=int(s.max_request_mb * 2**20), max_weight_body_bytes=int(s.max_weight_request_mb * 2**20),
                        max_in_flight=s.max_queued_requests, join_timeout_s=s.join_timeout_s)


def _embedded(cfg: TetherConfig, device: str, threads: int) -> dict[str, Any]:
    e = cfg.engine
    assert isinstance(e, EmbeddedEngineConfig)
    return dict(model_path=cfg.model.path, dtype=cfg.model.dtype, max_batch=e.max_generate_batch, threads=threads,
                device=device, deterministic=cfg.deterministic, max_batch_tokens=e.max_batch_tokens, host=e.host,
                seed=cfg.seed, onednn_linear=e.onednn_linear, prefix_cache_tokens=e.prefix_cache_tokens,
                limits=server_limits(cfg))


def _server_process(cfg: TetherConfig, device: str, threads: int) -> dict[str, Any]:
    """vLLM's and SGLang's actors: a server process started with the backend's own settings."""
    e = cfg.engine
    assert isinstance(e, (VllmConfig, SglangConfig))
    return dict(model_path=cfg.model.path, cfg=e.model_dump(mode="json"),
                dtype=cfg.model.dtype, seed=cfg.seed, device=device, threads=threads, host=e.host,
                log_dir=f"{cfg.output_dir}/engine_logs", request_timeout_s=cfg.cluster.call_timeout_s,
                limits=server_limits(cfg))


def _serving_lora(cfg: TetherConfig, device: str, threads: int) -> dict[str, Any]:
    """vLLM's and SGLang's actors also learn of the run's adapters: served as a LoRA, they change the launch."""
    lora = cfg.model.lora
    served = lora.model_dump(mode="json") if lora is not None and lora_push(cfg) == ADAPTER else None
    return {**_server_process(cfg, device, threads), "lora": served}


BACKENDS: dict[str, Backend] = {
    "embedded": Backend(EmbeddedEngineConfig, "tether.engine.actor:EngineActor", _embedded),
    "vllm": Backend(VllmConfig, "tether.engine.vllm:VllmEngineActor", _serving_lora,
                    startup_timeout_s=lambda e: e.startup_timeout_s, ranks=lambda e: e.tensor_parallel_size,
                    lora_push=lambda e: ADAPTER if e.lora_updates == "adapter" else WHOLE),
    "sglang": Backend(SglangConfig, "tether.engine.sglang:SglangEngineActor", _serving_lora,
                      startup_timeout_s=lambda e: e.startup_timeout_s, ranks=lambda e: e.tp_size,
                      lora_push=lambda e: ADAPTER if e.lora_updates == "adapter" else LAYERS, adapter_field="lora_path"),
    "external": Backend(ExternalEnginesConfig, None, lora_push=lambda e: WHOLE),
}


def backend(cfg: TetherConfig) -> Backend:
    return BACKENDS[cfg.engine.backend]


def lora_push(cfg: TetherConfig) -> str:
    """What this run's LoRA pushes carry to its engines (LAYERS, ADAPTER or WHOLE)."""
    return backend(cfg).lora_push(cfg.engine)


LORA_NAME = "tether-policy"  # the name a LoRA run's adapters are served under by every engine that serves them


def request_fields(cfg: TetherConfig) -> dict[str, str]:
    """Fields every /generate to the policy's engines carries: the served adapter's name where the
    engine serves the policy as a LoRA and needs each request to say so (SGLang)."""
    field = backend(cfg).adapter_field
    if field is None or cfg.model.lora is None or lora_push(cfg) != ADAPTER:
        return {}
    return {field: LORA_NAME}


def engine_spec(cfg: TetherConfig, device: str, threads: int) -> EngineSpec:
    """The actor class and its constructor arguments for one engine of the configured backend."""
    b = backend(cfg)
    if b.actor is None or b.arguments is None:
        raise ValueError(f"engine.backend: {cfg.engine.backend} starts no engines")
    module, name = b.actor.split(":")
    return getattr(importlib.import_module(module), name), b.arguments(cfg, device, threads)


def served_engines(cfg: TetherConfig) -> int:
    """Engines of served models that tether starts (each needs a bundle)."""
    return sum(m.placed for m in cfg.served_models.values())


def served_config(cfg: TetherConfig, name: str) -> TetherConfig:
    """The run's config as an engine of served model ``name`` sees it: that model's path and dtype, no
    adapters, and the run's engine backend (the embedded engine when the policy's engines are external)."""
    served = cfg.served_models[name]
    engine = cfg.engine if backend(cfg).actor is not None else EmbeddedEngineConfig()
    model = cfg.model.model_copy(update={"path": served.path, "dtype": served.dtype, "lora": None})
    return cfg.model_copy(update={"model": model, "engine": engine})


def startup_timeout_s(cfg: TetherConfig) -> float:
    """How long the engines may take to become healthy: a server backend's own start-up limit when
    it is longer than the call timeout (vLLM's first start on CPU compiles kernels)."""
    return max(cfg.cluster.call_timeout_s, backend(cfg).startup_timeout_s(cfg.engine))


def engine_ranks(cfg: TetherConfig) -> int:
    """Members each engine brings to the weight-update group: one per tensor-parallel worker."""
    return backend(cfg).ranks(cfg.engine)


def placed_engines(cfg: TetherConfig) -> int:
    """Engines that need placement-group bundles: none when tether starts none (engine.backend: external)."""
    return cfg.cluster.num_engines if backend(cfg).actor is not None else 0
