"""The serving core of the embedded engine: a request queue, admission control and one worker thread.

Requests from any number of clients (HTTP handlers, the rollout manager) are queued. Before every
decode step the worker admits the oldest waiting requests whose KV-cache need fits next to the
running ones (``max_batch_tokens`` bounds the rows times the widest row's prompt + max new tokens:
the running batch pads every row to the widest, batcher.py), as many as one step's prefill budget
holds, so requests join and leave the running batch continuously and a long prompt among short ones
cannot make every row as wide as itself. A request that waits is never refused for lack of room;
only one that could never fit is.

One thread owns the model: weight updates and memory release/resume are queued to the worker and
run between two decode steps, so pause, abort and weight updates act within one step of a running
batch. This also keeps torch's OpenMP pool to the one thread: a second thread that runs parallel
torch ops starts a second pool, and with more pool threads than cores libgomp stops spinning between
parallel regions, which costs a decode step ~20% on a 2-core CPU.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tether.engine.base import KV_CACHE
from tether.engine.batcher import ContinuousBatcher
from tether.engine.embedded import EmbeddedEngine, EngineError
from tether.engine.generate import GenerateOutput
from tether.engine.host_memory import reuse_large_blocks, trim_heap
from tether.engine.prefix_cache import PrefixCache
from tether.engine.sampling import SamplingParams


class RequestTooLarge(ValueError):
    """prompt + max_new_tokens exceeds the engine's KV budget: it could never be scheduled."""


@dataclass
class Request:
    input_ids: list[int]
    params: SamplingParams
    rid: str
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)
    on_tokens: Callable[[list[int], list[float]], None] | None = None
    """Streaming: called on the worker thread after each step with the tokens (and log-probs) the
    request gained in it, while it runs; the finished output still comes through ``future``."""
    streamed: int = 0  # tokens already handed to on_tokens
    probe: bool = False
    """A health probe (/health_generate): admitted at the next step, ahead of every waiting request and
    whatever the running batch holds, so it answers within a step however long the queue is."""

    @property
    def kv_tokens(self) -> int:
        return len(self.input_ids) + self.params.max_new_tokens


PREFILL_STEP_S = 3.0
"""What one step's prefill of newcomers should take: the rest wait for the next steps (chunked by
requests), so that no step runs for minutes while the running batch and health probes wait. The
prompts a step admits are sized by the prefill throughput measured so far."""


class EngineCore:
    def __init__(self, engine: EmbeddedEngine, tokenizer: Any, *, max_batch: int = 256,
                 max_batch_tokens: int = 1 << 16, prefix_cache_tokens: int = 0, seed: int = 0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        # Padded prompt tokens (distinct prompts x the longest) one step may prefill; follows the
        # measured prefill rate (PREFILL_STEP_S), from a start that any model clears in seconds on a GPU.
        self.prefill_budget = 4096
        self.vocab_size = engine.model.get_input_embeddings().num_embeddings
        # Positions past this are outside what the model was built for (RoPE tables, learned positions).
        self.max_positions = getattr(engine.model.config, "max_position_embeddings", None)
        self._rng = torch.Generator().manual_seed(seed)  # for requests without their own seed
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self._cached_weights = engine.weights_changed  # the weights the prefix cache's KV belongs to
        self.batcher = ContinuousBatcher(engine.model, engine.eos_ids, engine.pad_id, self._decode, self.prefix_cache)
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}  # admitted, in the running batch
        self._aborted: set[str] = set()
        self._streams: set[str] = set()  # rids of streaming requests not finished yet
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # model work from other threads
        self._cond = threading.Condition()
        self._paused = False
        self._stopping = False
        self._ids = itertools.count()
        self.stats = {"requests": 0, "prefills": 0, "generated_tokens": 0, "max_batch_seen": 0}
        self._worker = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ client side
    def submit(self, input_ids: list[int], params: SamplingParams, rid: str | None = None) -> Request:
        return self.submit_many([(input_ids, params, rid)])[0]

    def submit_many(self, items: list[tuple[list[int], SamplingParams, str | None]],
                    on_tokens: Callable[[list[int], list[float]], None] | None = None,
                    probe: bool = False) -> list[Request]:
        """Queue several requests at once: they are admitted in order, together when the step's prefill
        budget holds them. ``on_tokens``: stream the tokens of a single request as they come
        (Request.on_tokens). ``probe``: health probes, admitted first (Request.probe)."""
        if on_tokens is not None and len(items) != 1:
            raise ValueError(f"streaming takes one request at a time, got {len(items)}")
        reqs = []
        for input_ids, params, rid in items:
            if not input_ids:
                raise ValueError("input_ids is empty: generation needs at least one prompt token")
            req = Request(list(input_ids), params, rid or f"req-{next(self._ids)}", on_tokens=on_tokens, probe=probe)
            bad = next((i for i, t in enumerate(req.input_ids) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"request {req.rid}: input_ids[{bad}] = {req.input_ids[bad]} is outside the "
                                 f"model's vocabulary [0, {self.vocab_size})")
            if req.kv_tokens > self.max_batch_tokens:
                raise RequestTooLarge(f"request {req.rid} needs {req.kv_tokens} KV tokens (prompt {len(input_ids)} "
                                      f"+ max_new_tokens {params.max_new_tokens}) > engine budget {self.max_batch_tokens}")
            self._check_params(req)
            reqs.append(req)
        for req in reqs:
            if req.on_tokens is not None:
                self._streams.add(req.rid)
                req.future.add_done_callback(functools.partial(self._stream_done, req.rid))
        with self._cond:
            if probe:
                self._waiting.extendleft(reversed(reqs))
            else:
                self._waiting.extend(reqs)
            self.stats["requests"] += len(reqs)
            self._cond.notify()
        return reqs

    def _check_params(self, req: Request) -> None:
        """What only the model knows: token ids inside its vocabulary, lengths inside its positions."""
        p = req.params
        if p.top_k > self.vocab_size:
            raise ValueError(f"request {req.rid}: sampling_params.top_k = {p.top_k} is larger than the "
                             f"vocabulary ({self.vocab_size}); use -1 for no top-k")
        bad = [t for t in p.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"request {req.rid}: sampling_params.stop_token_ids {bad[:5]} are outside the "
                             f"model's vocabulary [0, {self.vocab_size})")
        if self.max_positions and req.kv_tokens > self.max_positions:
            raise ValueError(f"request {req.rid}: prompt ({len(req.input_ids)} tokens) + sampling_params."
                             f"max_new_tokens ({p.max_new_tokens}) = {req.kv_tokens} is beyond the model's "
                             f"{self.max_positions} positions")

    def generate(self, input_ids: list[int], params: SamplingParams, timeout_s: float | None = None) -> GenerateOutput:
        return self.submit(input_ids, params).future.result(timeout=timeout_s)

    def abort(self, rid: str | None = None) -> int:
        """Abort one request (or all with rid=None): waiting ones finish at once, running ones within a step."""
        with self._cond:
            hit = [r for r in self._waiting if rid is None or r.rid == rid]
            for req in hit:
                self._waiting.remove(req)
                req.future.set_result(GenerateOutput([], [], "abort"))
            running = [r for r in self._running if rid is None or r == rid]
            self._aborted.update(running)
        return len(hit) + len(running)

    def pause(self, abort: bool = False) -> None:
        """Hold generation in place (running batches stop before their next step) until resume;
        ``abort``: end every waiting and running request first (their partial outputs, finish reason
        abort), as SGLang's default pause mode does."""
        if abort:
            self.abort(None)  # the waiting ones at once
            self.exclusive(lambda: self._resolve(self.batcher.abort_all()))  # the running ones, now
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the worker thread, between two decode steps (also while paused); return its result."""
        if threading.current_thread() is self._worker:
            return fn()
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise EngineError("the engine core is shut down")
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result()

    def load(self) -> dict:
        with self._cond:
            return {"waiting": len(self._waiting), "running": len(self._running), "paused": self.paused}

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._worker.join(timeout=30)

    def release_memory(self, tags: list[str]) -> None:
        """Free weights and/or the KV cache; releasing the KV cache aborts the requests in flight."""
        def release() -> None:
            if KV_CACHE in tags:
                self._resolve(self.batcher.abort_all())
                self._flush_prefix_cache()
            self.engine.release_memory(tags)
        self.exclusive(release)

    def flush_cache(self) -> int:
        """Drop the cross-request prefix cache; returns how many cached tokens were dropped."""
        return self.exclusive(self._flush_prefix_cache)

    def _flush_prefix_cache(self) -> int:
        dropped = self.prefix_cache.tokens if self.prefix_cache is not None else 0
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return dropped

    def resume_memory(self, tags: list[str]) -> None:
        self.exclusive(lambda: self.engine.resume_memory(tags))

    def _stream_done(self, rid: str, _future: Future) -> None:
        self._streams.discard(rid)

    # ------------------------------------------------------------ worker side
    def _admit(self) -> list[Request]:
        """Waiting requests that fit next to the running ones (oldest first, probes before them), as many
        as this step's prefill budget holds (at least one)."""
        with self._cond:
            admitted: list[Request] = []
            distinct: set[tuple[int, ...]] = set()
            longest = 0
            # The running batch pads every row's KV to the widest row: a row costs the widest KV need.
            widest = max((r.kv_tokens for r in self._running.values()), default=0)
            while self._waiting:
                req = self._waiting[0]
                if not req.probe:
                    rows = len(self._running) + len(admitted) + 1
                    if rows > self.max_batch:
                        break
                    if rows * max(widest, req.kv_tokens) > self.max_batch_tokens:
                        break  # it waits for running requests to finish: queued, not refused
                # The prefill pads distinct prompts to the longest: that is what it costs.
                prompt = tuple(req.input_ids)
                width, rows = max(longest, len(prompt)), len(distinct | {prompt})
                if admitted and rows * width > self.prefill_budget and not req.probe:
                    break  # the next step takes it
                self._waiting.popleft()
                admitted.append(req)
                distinct.add(prompt)
                longest = width
                widest = max(widest, req.kv_tokens)
            for req in admitted:
                self._running[req.rid] = req
            return admitted

    def _measure_prefill(self, padded_tokens: int, seconds: float) -> None:
        """Size the next steps' prefill budget to PREFILL_STEP_S at the rate this prefill ran. Not in
        deterministic mode: batches are then the same on every run, whatever the machine's speed."""
        if padded_tokens >= 256 and seconds > 0 and not torch.are_deterministic_algorithms_enabled():
            target = int(padded_tokens / seconds * PREFILL_STEP_S)
            self.prefill_budget = max(256, min(self.max_batch_tokens, (self.prefill_budget + target) // 2))

    def _seed(self, req: Request) -> int:
        if req.params.seed is not None:
            return req.params.seed
        return int(torch.randint(0, 2**62, (1,), generator=self._rng))

    def _resolve(self, finished: list) -> None:
        with self._cond:
            for seq in finished:
                req: Request = seq.key
                self._running.pop(req.rid, None)
                self._aborted.discard(req.rid)
                self.stats["generated_tokens"] += len(seq.output_ids)
        for seq in finished:
            if not seq.key.future.done():
                seq.key.future.set_result(seq.output(self._decode))

    def _fail(self, requests: list[Request], exc: Exception) -> None:
        with self._cond:
            for req in requests:
                self._running.pop(req.rid, None)
        for req in requests:
            if not req.future.done():
                req.future.set_exception(exc)

    def _step(self) -> None:
        """One scheduling step: admit and prefill newcomers, then decode every running row once."""
        new = self._admit()
        if self.engine.weights_changed != self._cached_weights:  # cached KV is of the old weights
            self._flush_prefix_cache()
            self._cached_weights = self.engine.weights_changed
            trim_heap()  # once per weight update: the last rollout's batches are freed by now
        self.batcher.weight_version = self.engine.weight_version
        if new and (self.engine.released or self.engine.pending_weights):
            self._fail(new, EngineError(
                f"engine memory is released ({sorted(self.engine.released)}) or weights are not loaded: "
                "resume memory and push weights before generating"))
            new = []
        try:
            seqs = [self.batcher.new_sequence(r, r.input_ids, r.params, self._seed(r)) for r in new]
            started = time.perf_counter()
            finished = self.batcher.prefill(seqs)
            if new:
                distinct = {tuple(r.input_ids) for r in new}
                self._measure_prefill(len(distinct) * max(map(len, distinct)), time.perf_counter() - started)
            if len(self.batcher.batch):
                with self._cond:
                    abort_rows = {i for i, s in enumerate(self.batcher.batch.seqs) if s.key.rid in self._aborted}
                finished += self.batcher.decode_step(abort_rows)
        except Exception as exc:  # a failed step fails the requests in it (newcomers too), not the server
            newcomers = {r.rid for r in new}
            self._fail(new + [s.key for s in self.batcher.abort_all() if s.key.rid not in newcomers], exc)
            return
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(self.batcher.batch) + len(finished))
        self.stats["prefills"] += 1 if new else 0
        if self._streams:  # rollouts never stream: their steps skip this
            self._stream(self.batcher.batch.seqs)
        self._resolve(finished)

    @staticmethod
    def _stream(running: list) -> None:
        """Hand streaming requests the tokens this step gave them (finished ones get their whole
        output through the future instead, stop strings trimmed)."""
        for seq in running:
            req: Request = seq.key
            if req.on_tokens is not None and len(seq.output_ids) > req.streamed:
                start, req.streamed = req.streamed, len(seq.output_ids)
                req.on_tokens(seq.output_ids[start:], seq.output_logprobs[start:])

    def _next_work(self) -> tuple[list[tuple[Callable[[], Any], Future]], bool]:
        """Block until there is model work: (queued calls, whether to run a step); ([], False) to stop."""
        with self._cond:
            while not self._stopping and not self._calls and (self._paused or not (self._waiting or self._running)):
                self._cond.wait(timeout=1.0)  # paused: running requests hold in place, nothing is decoded
            calls = list(self._calls)
            self._calls.clear()
            if self._stopping:
                for _, future in calls:
                    future.set_exception(EngineError("the engine core is shut down"))
                return [], False
            return calls, not self._paused and bool(self._waiting or self._running)

    def _loop(self) -> None:
        while True:
            calls, step = self._next_work()
            if not calls and not step:
                return
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except Exception as exc:  # the caller gets it, the worker goes on
                    future.set_exception(exc)
            if step:
                self._step()


def start_engine_core(make_engine: Callable[[], EmbeddedEngine], **core_kwargs: Any) -> EngineCore:
    """Load an engine and start its core, keeping the caller's thread free of torch's OpenMP pool.

    The model is loaded in a short-lived thread: the pool its parallel ops start ends with that
    thread, so the core's worker is the only thread with one (see the module docstring).
    """
    built: Future = Future()

    def load() -> None:
        try:
            built.set_result(make_engine())
        except BaseException as exc:  # re-raised in the caller's thread below
            built.set_exception(exc)

    reuse_large_blocks()
    loader = threading.Thread(target=load, name="engine-loader")
    loader.start()
    loader.join()
    engine = built.result()
    return EngineCore(engine, engine.tokenizer, **core_kwargs)
