"""The engine contract's routes (base.HTTP_CONTRACT), written once. Every server tether puts in front of
an engine mounts them over its own ``ContractHandler``: server.py for the embedded engine,
vllm_adapter.py for vLLM (SGLang serves the contract itself). What a request must hold, the payload
decoding (payloads.py) and the status a refusal gets live here; a handler only does the work.

A handler method may be a coroutine (awaited on the server's loop) or a plain function, which runs
in the server's thread pool: the embedded engine blocks on its core's futures, the vLLM adapter
awaits vLLM."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable, Protocol

import anyio
import torch
from fastapi import FastAPI, HTTPException

from tether.engine.payloads import bucket_tensors, check_distributed, checked, memory_tags
from tether.engine.protocol import AbortIn, GenerateIn, InitGroupIn, PauseIn, TagsIn, UpdateDistributedIn, UpdateWeightsIn
from tether.run.faults import engine_fault
from tether.weight_sync.group import JoinError


class ContractHandler(Protocol):
    """Each method returns its value, or (as a coroutine function) an awaitable of it."""

    model_name: str

    @property
    def refused(self) -> tuple[type[Exception], ...]:
        """Errors of a weight update that are the request's fault (answered 400 with their message)."""

    def weight_version(self) -> int: ...
    def generate(self, body: GenerateIn) -> Any: ...
    def health(self) -> Any:
        """Fields for /health's reply (a dict)."""
    def health_generate(self) -> Any: ...
    def load(self) -> Any: ...
    def flush_cache(self) -> Any: ...
    def abort(self, rid: str | None) -> Any:
        """Abort request ``rid`` (None: all); how many were aborted."""
    def pause(self, mode: str) -> Any:
        """PauseIn.mode: abort running requests first, or hold them (in_place, retract)."""
    def resume(self) -> Any: ...
    def release_memory(self, tags: list[str]) -> Any: ...
    def resume_memory(self, tags: list[str]) -> Any: ...
    def load_bucket(self, tensors: dict[str, torch.Tensor], version: int) -> Any:
        """Load one bucket and commit ``version``; the version now served."""
    def join_group(self, body: InitGroupIn) -> Any:
        """Join the trainer's broadcast group (blocks until every member has); raises JoinError."""
    def receive_bucket(self, body: UpdateDistributedIn) -> Any:
        """Receive and load one broadcast bucket (committing body.weight_version when given)."""


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await anyio.to_thread.run_sync(partial(fn, *args))


def mount_contract(app: FastAPI, h: ContractHandler) -> FastAPI:
    @app.post("/generate")
    async def generate(body: GenerateIn) -> Any:
        engine_fault()
        return await _call(h.generate, body)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **await _call(h.health)}

    @app.get("/health_generate")
    async def health_generate() -> dict:
        await _call(h.health_generate)
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": h.model_name, "weight_version": h.weight_version(), "is_generation": True}

    @app.get("/get_load")
    async def get_load() -> dict:
        return await _call(h.load)

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        return {"success": True, **await _call(h.flush_cache)}

    @app.post("/abort_request")
    async def abort_request(body: AbortIn) -> dict:
        if not body.abort_all and body.rid is None:
            raise HTTPException(status_code=400, detail="give `rid` or `abort_all: true`")
        return {"success": True, "aborted": await _call(h.abort, None if body.abort_all else body.rid)}

    @app.post("/pause_generation")
    async def pause(body: PauseIn | None = None) -> dict:
        await _call(h.pause, body.mode if body is not None else "in_place")  # no body: hold
        return {"success": True}

    @app.post("/continue_generation")
    async def resume() -> dict:
        await _call(h.resume)
        return {"success": True}

    _mount_memory_routes(app, h)
    _mount_weight_routes(app, h)
    return app


def _mount_memory_routes(app: FastAPI, h: ContractHandler) -> None:
    @app.post("/release_memory_occupation")
    async def release(body: TagsIn) -> dict:
        return {"success": True, **await _call(h.release_memory, checked(memory_tags, body))}

    @app.post("/resume_memory_occupation")
    async def resume_memory(body: TagsIn) -> dict:
        return {"success": True, **await _call(h.resume_memory, checked(memory_tags, body))}


def _mount_weight_routes(app: FastAPI, h: ContractHandler) -> None:
    async def loaded(fn: Callable[..., Any], *args: Any) -> dict:
        try:
            return {"success": True, "weight_version": await _call(fn, *args)}
        except h.refused as err:
            raise HTTPException(status_code=400, detail=str(err)) from None

    @app.post("/update_weights_from_tensor")
    async def update_weights(body: UpdateWeightsIn) -> dict:
        tensors = checked(bucket_tensors, body)
        version = body.weight_version if body.weight_version is not None else h.weight_version() + 1
        return await loaded(h.load_bucket, tensors, version)

    @app.post("/init_weights_update_group")
    async def init_group(body: InitGroupIn) -> dict:
        try:
            await _call(h.join_group, body)
        except JoinError as err:
            raise HTTPException(status_code=err.status, detail=str(err)) from None
        return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}

    @app.post("/update_weights_from_distributed")
    async def update_distributed(body: UpdateDistributedIn) -> dict:
        checked(check_distributed, body)
        return await loaded(h.receive_bucket, body)
