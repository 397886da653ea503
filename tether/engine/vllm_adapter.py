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
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException

from tether.engine.protocol import GenerateIn, InitGroupIn, SamplingParamsIn, UpdateDistributedIn
from tether.engine.routes import mount_contract
from tether.http.client import async_client, pool_limits
from tether.http.guard import DEFAULT_LIMITS, ServerLimits, guard

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


class VllmHandler:
    """The contract's work, translated into vLLM's endpoints (routes.py mounts the routes over it).
    ``backend``: the VllmEngineActor (its vLLM URL, weight version and weight loading)."""

    refused = (KeyError, ValueError)

    def __init__(self, backend: Any, tokenizer: Any, model_name: str, request_timeout_s: float):
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self.timeout_s = request_timeout_s
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        # One pool for the server's event loop (uvicorn's), made on first use inside it.
        if self._client is None:
            self._client = async_client(self.timeout_s, limits=pool_limits(max_connections=None, max_keepalive=512))
        return self._client

    async def forward(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        reply = await self.client().request(method, f"{self.backend.vllm_url}{path}", **kwargs)
        _raise_for(reply, path)
        return reply

    async def one(self, prompt: list[int], sp: SamplingParamsIn, rid: str | None, logprob: bool) -> dict:
        rid = rid or uuid.uuid4().hex
        version = self.backend.weight_version
        body = {"request_id": rid, "token_ids": prompt, "sampling_params": vllm_sampling(sp, logprob),
                "output_mode": "text" if sp.stop else "tokens"}
        if self.backend.lora_name is not None:  # the policy is served as a LoRA of the base
            body["model"] = self.backend.lora_name
        reply = await self.forward("POST", "/inference/v1/generate", json=body)
        choice = reply.json()["choices"][0]
        text = self.tokenizer.decode(choice.get("token_ids") or [], skip_special_tokens=sp.skip_special_tokens)
        return sglang_reply(choice, rid, len(prompt), text, logprob, version)

    async def generate(self, body: GenerateIn) -> Any:
        if body.stream:
            raise HTTPException(status_code=400, detail="stream: true is not supported by the vLLM backend's "
                                                        "/generate (vLLM's own /v1 routes stream)")
        if body.scoring:
            raise HTTPException(status_code=400, detail="logprob_start_len (scoring a prompt) is not supported by the "
                                                        "vLLM backend's /generate; serve a teacher or reward model with "
                                                        "the embedded engine or SGLang")
        prompts = body.prompts(self.tokenizer)
        try:
            params, rids = body.per_prompt(len(prompts))
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from None
        out = await asyncio.gather(*(self.one(p, sp, rid, body.return_logprob)
                                     for p, sp, rid in zip(prompts, params, rids)))
        return list(out) if body.is_batch else out[0]

    def weight_version(self) -> int:
        return self.backend.weight_version

    async def health(self) -> dict:
        await self.forward("GET", "/health")
        return {}

    async def health_generate(self) -> None:
        await self.one([0], SamplingParamsIn(max_new_tokens=1, temperature=0.0), None, False)

    async def load(self) -> dict:
        return (await self.forward("GET", "/load")).json()

    async def flush_cache(self) -> dict:
        await self.forward("POST", "/reset_prefix_cache")
        return {}

    async def abort(self, rid: str | None) -> int:
        ids = {} if rid is None else {"request_ids": [VLLM_ID_PREFIX + rid]}
        reply = await self.forward("POST", "/abort_requests", json=ids)
        return reply.json().get("aborted", 0)

    async def pause(self, mode: str) -> None:
        # vLLM's keep: running requests hold with their KV (the contract's in_place; retract reads the same).
        await self.forward("POST", "/pause", params={"mode": "abort" if mode == "abort" else "keep"})

    async def resume(self) -> None:
        await self.forward("POST", "/resume")

    def release_memory(self, tags: list[str]) -> dict:
        self.backend.release_memory(tags)
        return {}

    def resume_memory(self, tags: list[str]) -> dict:
        self.backend.resume_memory(tags)
        return {}

    def load_bucket(self, tensors: dict, version: int) -> int:
        self.backend.load_tensors(tensors)
        return self.backend.commit_weights(version)

    def join_group(self, body: InitGroupIn) -> None:
        self.backend.join_weight_group(body)

    def receive_bucket(self, body: UpdateDistributedIn) -> int:
        return self.backend.receive_bucket(body)


def build_vllm_adapter(backend: Any, tokenizer: Any, model_name: str, request_timeout_s: float,
                       limits: ServerLimits = DEFAULT_LIMITS) -> FastAPI:
    return mount_contract(guard(FastAPI(title="tether vLLM adapter"), limits),
                          VllmHandler(backend, tokenizer, model_name, request_timeout_s))
