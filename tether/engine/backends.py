"""rollout.engine -> the engine actor class and its constructor arguments: one small function per
backend (the actors implement base.EngineBackend; their servers speak base.HTTP_CONTRACT)."""

from __future__ import annotations

from typing import Any, Callable

from tether.config import TetherConfig
from tether.http.guard import ServerLimits, api_key_from_env

EngineSpec = tuple[type, dict[str, Any]]  # (actor class, constructor keyword arguments)


def server_limits(cfg: TetherConfig) -> ServerLimits:
    """What the engines' HTTP servers enforce (tether/http/guard.py), from cluster.api_key and server:."""
    s = cfg.server
    return ServerLimits(api_key=cfg.cluster.api_key or api_key_from_env(), require_key_for_generate=s.require_key_for_generate,
                        max_body_bytes=int(s.max_request_mb * 2**20), max_weight_body_bytes=int(s.max_weight_request_mb * 2**20),
                        max_in_flight=s.max_queued_requests, join_timeout_s=s.join_timeout_s)


def _embedded(cfg: TetherConfig, device: str, threads: int) -> EngineSpec:
    from tether.engine.actor import EngineActor

    r = cfg.rollout
    return EngineActor, dict(
        model_path=cfg.model.path, dtype=cfg.model.dtype, max_batch=r.max_generate_batch, threads=threads,
        device=device, deterministic=cfg.deterministic, max_batch_tokens=r.max_batch_tokens, host=r.engine_host,
        seed=cfg.seed, onednn_linear=r.onednn_linear, prefix_cache_tokens=r.prefix_cache_tokens,
        limits=server_limits(cfg))


def _vllm(cfg: TetherConfig, device: str, threads: int) -> EngineSpec:
    from tether.engine.vllm import VllmEngineActor

    return VllmEngineActor, dict(
        model_path=cfg.model.path, cfg=cfg.vllm.model_dump(mode="json"), dtype=cfg.model.dtype, seed=cfg.seed,
        device=device, threads=threads, host=cfg.rollout.engine_host, log_dir=f"{cfg.output_dir}/engine_logs",
        request_timeout_s=cfg.cluster.call_timeout_s, limits=server_limits(cfg))


def _sglang(cfg: TetherConfig, device: str, threads: int) -> EngineSpec:
    from tether.engine.sglang import SglangEngineActor

    return SglangEngineActor, dict(
        model_path=cfg.model.path, cfg=cfg.sglang.model_dump(mode="json"), dtype=cfg.model.dtype, seed=cfg.seed,
        host=cfg.rollout.engine_host, log_dir=f"{cfg.output_dir}/engine_logs",
        request_timeout_s=cfg.cluster.call_timeout_s, limits=server_limits(cfg))


ENGINE_BACKENDS: dict[str, Callable[[TetherConfig, str, int], EngineSpec]] = {
    "embedded": _embedded, "vllm": _vllm, "sglang": _sglang}


def engine_spec(cfg: TetherConfig, device: str, threads: int) -> EngineSpec:
    return ENGINE_BACKENDS[cfg.rollout.engine](cfg, device, threads)


def startup_timeout_s(cfg: TetherConfig) -> float:
    """How long the engines may take to become healthy: a server backend's own start-up limit when
    it is longer than the call timeout (vLLM's first start on CPU compiles kernels)."""
    own = {"vllm": cfg.vllm.startup_timeout_s, "sglang": cfg.sglang.startup_timeout_s}.get(cfg.rollout.engine, 0.0)
    return max(cfg.cluster.call_timeout_s, own)


def engine_ranks(cfg: TetherConfig) -> int:
    """Members each engine brings to the weight-update group: one per tensor-parallel worker."""
    return {"vllm": cfg.vllm.tensor_parallel_size, "sglang": cfg.sglang.tp_size}.get(cfg.rollout.engine, 1)


def placed_engines(cfg: TetherConfig) -> int:
    """Engines that need placement-group bundles: none when they are rollout.external_engines."""
    return 0 if cfg.rollout.external_engines else cfg.cluster.num_engines
