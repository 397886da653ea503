"""The embedded engine's HTTP server: SGLang-compatible endpoints plus OpenAI-compatible completions.

    /generate  /health  /health_generate  /flush_cache  /abort_request
    /pause_generation  /continue_generation  /release_memory_occupation  /resume_memory_occupation
    /update_weights_from_tensor  /get_model_info  /get_load
    /v1/models  /v1/completions  /v1/chat/completions

Loopback by default. Each request waits on its future in the server's thread pool (sync routes, or
anyio's threads for the async ones), so concurrent clients batch together in the engine core.
``"stream": true`` answers with server-sent events instead (streaming.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, HTTPException

from tether.engine.core import EngineCore, RequestTooLarge
from tether.engine.embedded import EngineError
from tether.engine.streaming import openai_events, sglang_events, sse, token_steps
from tether.engine.protocol import (
    ChatIn, CompletionIn, GenerateIn, InitGroupIn, SamplingParamsIn, UpdateDistributedIn, include_usage, openai_usage,
    response, scored,
)
from tether.engine.routes import mount_contract
from tether.run.faults import engine_update_fault
from tether.http.guard import DEFAULT_LIMITS, ServerLimits, guard
from tether.http.server import ThreadedServer
from tether.weight_sync.group import GroupJoiner, Receiver
from tether.errors import TIMEOUTS

MAX_CONCURRENT_REQUESTS = 512


def _bad_request(err: Exception) -> HTTPException:
    return HTTPException(status_code=400, detail=str(err))


@asynccontextmanager
async def _lifespan(app: FastAPI):
    # Sync handlers run in anyio's thread pool (40 threads by default). A rollout keeps one request per
    # group in flight; below this limit every one of them reaches the engine core (so it can batch them,
    # and abort them by rid) instead of queueing in front of the server.
    anyio.to_thread.current_default_thread_limiter().total_tokens = MAX_CONCURRENT_REQUESTS
    yield


class EmbeddedHandler:
    """The contract's work on the embedded engine's core (routes.py mounts the routes over it)."""

    refused = (EngineError, ValueError)

    def __init__(self, core: EngineCore, model_name: str, request_timeout_s: float, join_timeout_s: float):
        self.core, self.model_name, self.timeout_s = core, model_name, request_timeout_s
        self.tokenizer = core.tokenizer
        self.groups: dict[str, Receiver] = {}
        self.joiner = GroupJoiner(join_timeout_s)

    def run(self, prompts: list[list[int]], params: list[SamplingParamsIn], rids: list[str | None]) -> list:
        """Submit, then wait for every request (in a server thread); the failures as HTTP statuses."""
        core = self.core
        try:
            reqs = core.submit_many([(p, sp.to_params(), rid) for p, sp, rid in zip(prompts, params, rids)])
        except (ValueError, RequestTooLarge) as err:
            raise _bad_request(err) from None
        try:
            return [(req, req.future.result(timeout=self.timeout_s)) for req in reqs]
        except EngineError as err:
            raise HTTPException(status_code=503, detail=str(err)) from None
        except TIMEOUTS:
            for req in reqs:
                core.abort(req.rid)
            raise HTTPException(status_code=504, detail=f"generation of {len(reqs)} request(s) took over "
                                                        f"{self.timeout_s}s; aborted") from None
        except Exception as err:  # the engine step failed: say why instead of a bare 500
            raise HTTPException(status_code=500, detail=f"generation failed: {type(err).__name__}: {err}") from None

    def decode(self, ids: list[int], skip: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _generate_all(self, body: GenerateIn) -> Any:
        prompts = body.prompts(self.tokenizer)
        try:
            params, rids = body.per_prompt(len(prompts))
        except ValueError as err:
            raise _bad_request(err) from None
        if body.scoring:
            return self._score(body, prompts, params, rids)
        results = self.run(prompts, params, rids)
        version = self.core.engine.weight_version
        out = [response(o, req.rid, len(req.input_ids), _text(o, self.decode, sp), body.return_logprob, version)
               for (req, o), sp in zip(results, params)]
        return out if body.is_batch else out[0]

    def _score(self, body: GenerateIn, prompts: list[list[int]], params: list[SamplingParamsIn],
               rids: list[str | None]) -> Any:
        """The prompts' own log-probs (a teacher's or a reward model's scores), one forward each, between
        the core's decode steps; temperature divides the logits as it would when sampling."""
        try:
            starts = body.logprob_starts(len(prompts))
        except ValueError as err:
            raise _bad_request(err) from None
        engine = self.core.engine
        temperatures = [p.temperature for p in params]
        values = self.core.exclusive(lambda: engine.prompt_logprobs(prompts, temperatures))
        version = engine.weight_version
        out = [scored(ids, lps, start, rid, version) for ids, lps, start, rid in zip(prompts, values, starts, rids)]
        return out if body.is_batch else out[0]

    async def submit_stream(self, prompt: list[int], sp: SamplingParamsIn, rid: str | None):
        try:
            return await token_steps(self.core, prompt, sp.to_params(), rid, self.timeout_s)
        except (ValueError, RequestTooLarge) as err:
            raise _bad_request(err) from None

    async def generate(self, body: GenerateIn) -> Any:
        if not body.stream:  # the engine core's future is waited on in a thread, as for sync routes
            return await anyio.to_thread.run_sync(self._generate_all, body)
        if body.is_batch or body.scoring:
            raise _bad_request(ValueError("stream: true takes one prompt to generate from, not a batch or a "
                                          "scoring request"))
        (params,), (rid,) = body.per_prompt(1)
        req, steps = await self.submit_stream(body.prompts(self.tokenizer)[0], params, rid)
        decode = self.decode
        return sse(sglang_events(req, steps, lambda o: _text(o, decode, params), response,
                                 lambda ids: decode(ids, params.skip_special_tokens), body.return_logprob,
                                 self.weight_version), self.timeout_s)

    def weight_version(self) -> int:
        return self.core.engine.weight_version

    # Health and load answer on the event loop, never from the thread pool: a rollout's or an eval's
    # requests can hold every one of its threads (each waits on its generation), and the health
    # watchdog must still get an answer.
    async def health(self) -> dict:
        return self.core.load()

    async def health_generate(self) -> None:
        """A one-token generation, admitted ahead of the queue: it answers within a step (or two) of a
        busy engine, and not at all from a frozen one."""
        ids = self.tokenizer.encode("0", add_special_tokens=False) or [0]
        req = self.core.submit_many([(ids, SamplingParamsIn(max_new_tokens=1, temperature=0.0).to_params(), None)],
                                    probe=True)[0]
        try:
            await asyncio.wait_for(asyncio.wrap_future(req.future), self.timeout_s)
        except EngineError as err:
            raise HTTPException(status_code=503, detail=str(err)) from None
        except TIMEOUTS:
            self.core.abort(req.rid)
            raise HTTPException(status_code=504, detail=f"the health probe took over {self.timeout_s}s") from None

    async def load(self) -> dict:
        core, cache = self.core, self.core.prefix_cache
        prefix = {} if cache is None else {"prefix_cache": {"tokens": cache.tokens, "entries": len(cache), **cache.stats}}
        return {**core.load(), **core.stats, **core.batcher.stats, **prefix}

    def flush_cache(self) -> dict:
        return {"flushed_tokens": self.core.flush_cache()}

    def abort(self, rid: str | None) -> int:
        return self.core.abort(rid)

    def pause(self, mode: str) -> None:
        self.core.pause(abort=mode == "abort")

    def resume(self) -> None:
        self.core.resume()

    def release_memory(self, tags: list[str]) -> dict:
        self.core.release_memory(tags)
        return {"released": sorted(self.core.engine.released)}

    def resume_memory(self, tags: list[str]) -> dict:
        self.core.resume_memory(tags)
        return {"released": sorted(self.core.engine.released)}

    def load_bucket(self, tensors: dict, version: int) -> int:
        engine_update_fault()
        engine = self.core.engine

        def apply() -> int:
            engine.load_weight_bucket(tensors, version)
            return engine.commit_weights(version)

        return self.core.exclusive(apply)

    def join_group(self, body: InitGroupIn) -> None:
        # Blocks until every member (the trainer's rank 0 and all engines) has joined.
        group = self.joiner.join(body.master_address, body.master_port, body.rank_offset, body.world_size,
                                 body.backend, body.group_name)
        for old in self.groups.values():  # a trainer that sets the transport up again does it for everyone
            old.close()
        self.groups.clear()
        # Over gloo (a CPU transport) buckets land in host memory and the engine copies them to its device.
        self.groups[body.group_name] = Receiver(group, self.core.engine.device if body.backend == "nccl" else "cpu")

    def receive_bucket(self, body: UpdateDistributedIn) -> int:
        engine_update_fault()
        receiver = self.groups.get(body.group_name)
        if receiver is None:
            raise ValueError(f"no weight-update group {body.group_name!r}: call /init_weights_update_group")
        engine, version = self.core.engine, body.weight_version
        # Receive outside the model lock (generation goes on), then load between two decode steps.
        with receiver.lock:
            tensors = receiver.receive(body.names, body.dtypes, body.shapes)

            def apply() -> int:
                engine.load_weight_bucket(tensors, version if version is not None else engine.weight_version)
                return engine.commit_weights(version) if version is not None else engine.weight_version

            try:
                loaded = self.core.exclusive(apply)
            except EngineError:
                receiver.done()
                raise
            if version is not None:  # the push is complete: free the receive buffer until the next one
                receiver.done()
            return loaded


def build_app(core: EngineCore, model_name: str = "tether-embedded", request_timeout_s: float = 600.0,
              limits: ServerLimits = DEFAULT_LIMITS) -> FastAPI:
    app = guard(FastAPI(title="tether engine", lifespan=_lifespan), limits)
    handler = EmbeddedHandler(core, model_name, request_timeout_s, limits.join_timeout_s)
    mount_contract(app, handler)
    _add_openai_routes(app, core, handler.run, handler.decode, model_name, handler.submit_stream, request_timeout_s)
    return app


def _text(out, decode, params: SamplingParamsIn) -> str:
    text = decode(out.output_ids, params.skip_special_tokens)
    if out.finish_reason == "stop" and isinstance(out.matched_stop, str):
        text = text[: text.find(out.matched_stop)] if out.matched_stop in text else text
    return text



def _add_openai_routes(app: FastAPI, core: EngineCore, run, decode, model_name: str, submit_stream,
                       timeout_s: float) -> None:
    tokenizer = core.tokenizer

    def sampling(max_tokens: int, temperature: float, top_p: float, stop, seed) -> SamplingParamsIn:
        return SamplingParamsIn(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop,
                                sampling_seed=seed)

    def usage(req, out) -> dict:
        return openai_usage(len(req.input_ids), len(out.output_ids))

    async def stream(ids: list[int], sp: SamplingParamsIn, head: dict, chat: bool, body) -> Any:
        req, steps = await submit_stream(ids, sp, None)
        return sse(openai_events(req, steps, lambda o: _text(o, decode, sp), decode, head, chat,
                                 include_usage(body.stream_options), _openai_finish), timeout_s)

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "tether"}]}

    def complete(body: CompletionIn, ids: list[int], sp: SamplingParamsIn, head: dict) -> dict:
        (req, out), = run([ids], [sp], [None])
        choice = {"index": 0, "text": _text(out, decode, sp), "finish_reason": _openai_finish(out)}
        if body.logprobs is not None:
            choice["logprobs"] = {"tokens": [decode([t], False) for t in out.output_ids],
                                  "token_logprobs": out.output_logprobs}
        return {**head, "choices": [choice], "usage": usage(req, out)}

    @app.post("/v1/completions")
    async def completions(body: CompletionIn) -> Any:
        ids = body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt, add_special_tokens=False)
        sp = sampling(body.max_tokens, body.temperature, body.top_p, body.stop, body.seed)
        head = {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        if body.stream:
            return await stream(ids, sp, head, False, body)
        return await anyio.to_thread.run_sync(complete, body, ids, sp, head)

    def chat_reply(body: ChatIn, ids: list[int], sp: SamplingParamsIn, head: dict) -> dict:
        (req, out), = run([ids], [sp], [None])
        choice = {"index": 0, "message": {"role": "assistant", "content": _text(out, decode, sp)},
                  "finish_reason": _openai_finish(out)}
        if body.logprobs:
            choice["logprobs"] = {"content": [{"token": decode([t], False), "logprob": lp}
                                              for t, lp in zip(out.output_ids, out.output_logprobs)]}
        return {**head, "choices": [choice], "usage": usage(req, out)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatIn) -> Any:
        if not getattr(tokenizer, "chat_template", None):
            raise _bad_request(ValueError("the model's tokenizer has no chat template"))
        text = tokenizer.apply_chat_template(body.messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        sp = sampling(body.max_completion_tokens or body.max_tokens or 128, body.temperature, body.top_p,
                      body.stop, body.seed)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "created": int(time.time()), "model": model_name}
        if body.stream:
            return await stream(ids, sp, {**head, "object": "chat.completion.chunk"}, True, body)
        return await anyio.to_thread.run_sync(chat_reply, body, ids, sp, {**head, "object": "chat.completion"})


def _openai_finish(out) -> str:
    return {"length": "length", "abort": "abort"}.get(out.finish_reason, "stop")


class EngineServer(ThreadedServer):
    """Runs the app with uvicorn in a background thread; ``url`` is where it listens."""

    def __init__(self, core: EngineCore, host: str = "127.0.0.1", port: int = 0, model_name: str = "tether-embedded",
                 limits: ServerLimits = DEFAULT_LIMITS):
        self.core = core
        super().__init__(build_app(core, model_name, limits=limits), host, port, "engine HTTP server")

    def stop(self) -> None:
        super().stop()
        self.core.shutdown()
