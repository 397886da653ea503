"""The serving core of the embedded engine: a request queue, admission control and one worker thread.

Requests from any number of clients (HTTP handlers, the rollout manager) are queued; the worker
forms a batch from the oldest waiting requests whose KV-cache need fits the budget
(``max_batch_tokens`` = sum of prompt + max new tokens), runs it, and resolves each request's
future. A request that waits is never refused for lack of room; only one that could never fit is.

Everything that touches the model (weight updates, memory release/resume, generation) holds one
lock. The worker releases it between decode steps, so pause, abort and weight updates act within
one step of a running batch.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tether.engine.embedded import EmbeddedEngine, EngineError
from tether.engine.generate import GenerateOutput, generate_batch
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

    @property
    def kv_tokens(self) -> int:
        return len(self.input_ids) + self.params.max_new_tokens


class EngineCore:
    def __init__(self, engine: EmbeddedEngine, tokenizer: Any, *, max_batch: int = 256,
                 max_batch_tokens: int = 1 << 16, seed: int = 0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self._rng = torch.Generator().manual_seed(seed)  # for requests without their own seed
        self._waiting: deque[Request] = deque()
        self._running: dict[str, int] = {}  # rid -> row of the running batch
        self._aborted: set[str] = set()
        self._cond = threading.Condition()
        self._model_lock = threading.RLock()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._stopping = False
        self._ids = itertools.count()
        self.stats = {"requests": 0, "batches": 0, "generated_tokens": 0, "max_batch_seen": 0}
        self._worker = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ client side
    def submit(self, input_ids: list[int], params: SamplingParams, rid: str | None = None) -> Request:
        if not input_ids:
            raise ValueError("input_ids is empty: generation needs at least one prompt token")
        req = Request(list(input_ids), params, rid or f"req-{next(self._ids)}")
        if req.kv_tokens > self.max_batch_tokens:
            raise RequestTooLarge(f"request {req.rid} needs {req.kv_tokens} KV tokens (prompt {len(input_ids)} + "
                                  f"max_new_tokens {params.max_new_tokens}) > engine budget {self.max_batch_tokens}")
        with self._cond:
            self._waiting.append(req)
            self.stats["requests"] += 1
            self._cond.notify()
        return req

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

    def pause(self) -> None:
        """Hold generation in place (running batches stop before their next step) until resume."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run fn with the model to itself (between decode steps of a running batch)."""
        with self._model_lock:
            return fn()

    def load(self) -> dict:
        with self._cond:
            return {"waiting": len(self._waiting), "running": len(self._running), "paused": self.paused}

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._unpaused.set()
        self._worker.join(timeout=30)

    # ------------------------------------------------------------ worker side
    def _next_batch(self) -> list[Request]:
        """The oldest waiting requests that fit the KV budget together (first come, first served)."""
        with self._cond:
            while not self._waiting and not self._stopping:
                self._cond.wait(timeout=1.0)
            batch, tokens = [], 0
            while self._waiting and len(batch) < self.max_batch:
                need = self._waiting[0].kv_tokens
                if batch and tokens + need > self.max_batch_tokens:
                    break  # the rest waits for the next batch: queued, not refused
                batch.append(self._waiting.popleft())
                tokens += need
            self._running = {req.rid: row for row, req in enumerate(batch)}
            return batch

    def _between_steps(self) -> set[int]:
        """Called by generate_batch before each decode step: pause point, lock hand-off, aborts."""
        self._model_lock.release()
        try:
            self._unpaused.wait()
        finally:
            self._model_lock.acquire()
        with self._cond:
            return {self._running[rid] for rid in self._aborted if rid in self._running}

    def _generators(self, batch: list[Request]) -> list[torch.Generator]:
        out = []
        for req in batch:
            seed = req.params.seed if req.params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
            out.append(torch.Generator().manual_seed(seed))
        return out

    def _run(self, batch: list[Request]) -> None:
        self._unpaused.wait()
        with self._model_lock:
            if self.engine.released or self.engine.pending_weights:
                raise EngineError(f"engine memory is released ({sorted(self.engine.released)}) or weights are "
                                  "not loaded: resume memory and push weights before generating")
            outputs = generate_batch(
                self.engine.model, [r.input_ids for r in batch], [r.params for r in batch], self.engine.eos_ids,
                self.engine.pad_id, self._generators(batch), should_abort=self._between_steps,
                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        for req, out in zip(batch, outputs):
            req.future.set_result(out)
        self.stats["batches"] += 1
        self.stats["generated_tokens"] += sum(len(o.output_ids) for o in outputs)
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(batch))

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch:
                if self._stopping:
                    return
                continue
            try:
                self._run(batch)
            except Exception as exc:  # a failed batch fails its requests, not the server
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
            finally:
                with self._cond:
                    self._aborted.difference_update(self._running)
                    self._running = {}
