"""The engine contract (base.HTTP_CONTRACT) in front of a vLLM server: SGLang-shaped requests in,
vLLM's own endpoints out.

vLLM (>= 0.32, started with VLLM_SERVER_DEV_MODE=1 and --enable-scale-out) has what a rollout needs,
under other names: token-in/token-out generation with a caller's request id and per-span weight
versions (/inference/v1/generate), abort by id (/abort_requests), pause that keeps running requests
(/pause?mode=keep, /resume), sleep/wake (GPU only; a no-op on CPU), prefix-cache reset, and
/collective_rpc into the workers, which is how weights arrive (vllm_worker.py). This app translates;
it runs in the engine actor, one hop in front of vLLM on the same host.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable

import httpx
from fastapi import FastAPI, HTTPException

from tether.run.faults import engine_fault
from tether.engine.payloads import bucket_tensors, check_distributed, checked, memory_tags
from tether.engine.protocol import (AbortIn, GenerateIn, InitGroupIn, SamplingParamsIn, TagsIn, UpdateDistributedIn,
                                    UpdateWeightsIn)
from tether.http.client import async_client, pool_limits
from tether.http.guard import DEFAULT_LIMITS, ServerLimits, guard
from tether.weight_sync.group import JoinError

VLLM_ID_PREFIX = "generate-tokens-"  # vLLM's /inference/v1/generate prefixes the caller's request id


def vllm_sampling(sp: SamplingParamsIn, logprobs: bool) -> dict[str, Any]:
    """SGLang sampling parameters as vLLM's."""
    out: dict[str, Any] = {"max_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                           "top_k": max(sp.top_k, 0), "min_p": sp.min_p, "ignore_eos": sp.ignore_eos,
                           "skip_special_tokens": sp.skip_special_tokens}
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.stop:
        out["stop"] = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
    if sp.sampling_seed is not None:
        out["seed"] = sp.sampling_seed
    if logprobs:
        out["logprobs"] = 0  # the sampled token's own log-prob only
    return out


def version_spans(spans: list[dict] | None, version: int) -> list[list[int]]:
    """vLLM's [{version, start, end}] as the contract's [[version, tokens], ...]; a label that is not a
    number (vLLM's "default" before the first push) is the version the server started with."""
    out: list[list[int]] = []
    for span in spans or []:
        label = span["version"]
        number = int(label) if str(label).lstrip("-").isdigit() else version
        if out and out[-1][0] == number:
            out[-1][1] += span["end"] - span["start"]
        else:
            out.append([number, span["end"] - span["start"]])
    return out


def sglang_reply(choice: dict, rid: str, prompt_len: int, text: str, return_logprob: bool, version: int) -> dict:
    """One vLLM choice as an SGLang /generate reply."""
    ids = list(choice.get("token_ids") or [])
    reason = choice.get("finish_reason")
    if reason == "length":
        finish = {"type": "length", "length": len(ids)}
    elif reason == "abort":
        finish = {"type": "abort", "message": "aborted"}
    else:
        finish = {"type": "stop", "matched": choice.get("stop_reason")}
    spans = version_spans(choice.get("weight_versions"), version)
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_len,
                            "completion_tokens": len(ids), "weight_version": spans[0][0] if spans else version}
    if len(spans) > 1:
        meta["weight_version_spans"] = spans
    if return_logprob:
        content = (choice.get("logprobs") or {}).get("content") or []
        meta["output_token_logprobs"] = [[c["logprob"], c["token_id"], None] for c in content]
    return {"text": text, "output_ids": ids, "meta_info": meta}


def _raise_for(reply: httpx.Response, what: str) -> None:
    if reply.status_code != 200:
        # vLLM's 4xx are the caller's errors (said in vLLM's words); anything else is the server's.
        status = reply.status_code if 400 <= reply.status_code < 500 else 502
        raise HTTPException(status_code=status, detail=f"vLLM {what} answered {reply.status_code}: {reply.text[:2000]}")


def build_vllm_adapter(backend: Any, tokenizer: Any, model_name: str, request_timeout_s: float,
                       limits: ServerLimits = DEFAULT_LIMITS) -> FastAPI:
    """``backend``: the VllmEngineActor (its vLLM URL, weight version and weight loading)."""
    app = guard(FastAPI(title="tether vLLM adapter"), limits)
    state: dict[str, httpx.AsyncClient] = {}

    def client() -> httpx.AsyncClient:
        # One pool per event loop (uvicorn's), made on first use inside it.
        if "c" not in state:
            state["c"] = async_client(request_timeout_s, limits=pool_limits(max_connections=None, max_keepalive=512))
        return state["c"]

    async def one(prompt: list[int], sp: SamplingParamsIn, rid: str | None, logprob: bool) -> dict:
        rid = rid or uuid.uuid4().hex
        version = backend.weight_version
        body = {"request_id": rid, "token_ids": prompt, "sampling_params": vllm_sampling(sp, logprob),
                "output_mode": "text" if sp.stop else "tokens"}
        reply = await client().post(f"{backend.vllm_url}/inference/v1/generate", json=body)
        _raise_for(reply, "/inference/v1/generate")
        choice = reply.json()["choices"][0]
        text = tokenizer.decode(choice.get("token_ids") or [], skip_special_tokens=sp.skip_special_tokens)
        return sglang_reply(choice, rid, len(prompt), text, logprob, version)

    @app.post("/generate")
    async def generate(body: GenerateIn) -> Any:
        engine_fault()
        if body.stream:
            raise HTTPException(status_code=400, detail="stream: true is not supported by the vLLM backend's "
                                                        "/generate (vLLM's own /v1 routes stream)")
        prompts = body.prompts(tokenizer)
        try:
            params, rids = body.per_prompt(len(prompts))
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from None
        out = await asyncio.gather(*(one(p, sp, rid, body.return_logprob) for p, sp, rid in zip(prompts, params, rids)))
        return list(out) if body.is_batch else out[0]

    async def forward(method: str, path: str, **kwargs: Any) -> httpx.Response:
        reply = await client().request(method, f"{backend.vllm_url}{path}", **kwargs)
        _raise_for(reply, path)
        return reply

    @app.get("/health")
    async def health() -> dict:
        await forward("GET", "/health")
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate() -> dict:
        await one([0], SamplingParamsIn(max_new_tokens=1, temperature=0.0), None, False)
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": model_name, "weight_version": backend.weight_version, "is_generation": True}

    @app.get("/get_load")
    async def get_load() -> dict:
        return (await forward("GET", "/load")).json()

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        await forward("POST", "/reset_prefix_cache")
        return {"success": True}

    @app.post("/abort_request")
    async def abort_request(body: AbortIn) -> dict:
        if not body.abort_all and body.rid is None:
            raise HTTPException(status_code=400, detail="give `rid` or `abort_all: true`")
        ids = {} if body.abort_all else {"request_ids": [VLLM_ID_PREFIX + body.rid]}
        reply = await forward("POST", "/abort_requests", json=ids)
        return {"success": True, "aborted": reply.json().get("aborted", 0)}

    @app.post("/pause_generation")
    async def pause() -> dict:
        await forward("POST", "/pause", params={"mode": "keep"})  # running requests hold, KV kept
        return {"success": True}

    @app.post("/continue_generation")
    async def resume() -> dict:
        await forward("POST", "/resume")
        return {"success": True}

    _add_memory_routes(app, backend)
    _add_weight_routes(app, backend)
    return app



def _add_memory_routes(app: FastAPI, backend: Any) -> None:
    @app.post("/release_memory_occupation")
    def release(body: TagsIn) -> dict:
        backend.release_memory(checked(memory_tags, body))
        return {"success": True}

    @app.post("/resume_memory_occupation")
    def resume_memory(body: TagsIn) -> dict:
        backend.resume_memory(checked(memory_tags, body))
        return {"success": True}


def _add_weight_routes(app: FastAPI, backend: Any) -> None:
    def guarded(load: Callable[[], int]) -> dict:
        try:
            return {"success": True, "weight_version": load()}
        except (KeyError, ValueError) as err:
            raise HTTPException(status_code=400, detail=str(err)) from None

    @app.post("/update_weights_from_tensor")
    def update_weights(body: UpdateWeightsIn) -> dict:
        tensors = checked(bucket_tensors, body)
        version = body.weight_version if body.weight_version is not None else backend.weight_version + 1

        def load() -> int:
            backend.load_tensors(tensors)
            return backend.commit_weights(version)

        return guarded(load)

    @app.post("/init_weights_update_group")
    def init_group(body: InitGroupIn) -> dict:
        try:
            backend.join_weight_group(body)
        except JoinError as err:
            raise HTTPException(status_code=err.status, detail=str(err)) from None
        return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}

    @app.post("/update_weights_from_distributed")
    def update_distributed(body: UpdateDistributedIn) -> dict:
        checked(check_distributed, body)
        return guarded(lambda: backend.receive_bucket(body))
