"""verifiers environments as tether rollouts (``rollout.environment: {type: verifiers, env_id: my-env}``).

A verifiers environment (``vf.load_environment(env_id, **env_args)``: its dataset, its rollout logic,
single- or multi-turn, with tools, and its rubric) runs as it is, in the Python environment that has
verifiers and the environment's module (``python:``; verifiers brings dozens of packages tether does
not need). There, a worker (tether/envs/verifiers_worker.py, started once per process) plays each
rollout against the sample's chat session: the environment calls the policy through the OpenAI chat
API it already speaks, and the session records every turn with the engine's exact tokens
(tether/rollout/chat_session.py); the rubric's score is the sample's reward, its other functions the
sample's metrics. Prompts are the environment's own dataset: ``tether`` writes it as JSONL to
``<output_dir>/data/`` at start-up when ``data.path`` is not set (``eval.datasets`` entries with
``verifiers_split: eval`` get its eval split).

The worker answers JSON lines matched by id, many rollouts at once. A worker that dies fails the
samples it was playing (kind environment: retried, then masked) and is started again for the next.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tether.envs.config import VerifiersConfig
from tether.errors import EnvironmentFailure
from tether.rollout.generate_fn import GenerateContext
from tether.run.faults import inject_fault
from tether.sample import Sample

WORKER = Path(__file__).with_name("verifiers_worker.py")
ROW_FIELDS = ("info", "task", "example_id")
"""A verifiers row's fields besides prompt and answer (the answer is the label): kept in metadata."""


def python_of(c: VerifiersConfig) -> str:
    return c.python or sys.executable


class VerifiersWorker:
    """The worker process of one Python, shared by the rollouts of this process's event loop."""

    _workers: dict[tuple[str, int], VerifiersWorker] = {}

    def __init__(self, python: str, cwd: str | None):
        self.python, self.cwd = python, cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.reader: asyncio.Task | None = None
        self._start_lock = asyncio.Lock()

    @classmethod
    def shared(cls, python: str, cwd: str | None) -> VerifiersWorker:
        key = (python, id(asyncio.get_running_loop()))
        if key not in cls._workers:
            cls._workers[key] = cls(python, cwd)
        return cls._workers[key]

    async def _ensure(self) -> asyncio.subprocess.Process:
        async with self._start_lock:
            if self.proc is not None and self.proc.returncode is None:
                return self.proc
            self.proc = await asyncio.create_subprocess_exec(
                self.python, str(WORKER), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, cwd=self.cwd,
                limit=1 << 26, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [self.cwd or "",
                                                                                               os.environ.get("PYTHONPATH", "")]))})
            assert self.proc.stdout is not None
            ready = await asyncio.wait_for(self.proc.stdout.readline(), 120)
            if not ready:
                raise EnvironmentFailure(f"verifiers worker ({self.python}) exited at start: is verifiers installed "
                                         "there? (rollout.environment.python)")
            self.reader = asyncio.ensure_future(self._read(self.proc))
            return self.proc

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            reply = json.loads(line)
            future = self.pending.pop(reply.get("id"), None)
            if future is not None and not future.done():
                future.set_result(reply)
        code = await proc.wait()
        for future in self.pending.values():  # the worker died: what it was playing fails
            if not future.done():
                future.set_exception(EnvironmentFailure(f"verifiers worker ({self.python}) exited with {code}"))
        self.pending.clear()

    async def call(self, request: dict, timeout_s: float) -> dict:
        proc = await self._ensure()
        assert proc.stdin is not None
        rid = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        proc.stdin.write((json.dumps({**request, "id": rid}) + "\n").encode())
        await proc.stdin.drain()
        try:
            reply = await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            self.pending.pop(rid, None)
            raise EnvironmentFailure(f"verifiers worker: no answer to {request['op']} within {timeout_s:g}s") from None
        if reply.get("error") and request["op"] != "rollout":
            raise EnvironmentFailure(f"verifiers {request['op']} of '{request['env_id']}': {reply['error']}\n"
                                     f"{reply.get('where', '')}")
        return reply


def verifiers_row(sample: Sample) -> dict[str, Any]:
    meta = sample.metadata if isinstance(sample.metadata, dict) else {}
    return {"prompt": sample.prompt, "answer": sample.label if sample.label is not None else "",
            **{k: meta[k] for k in ROW_FIELDS if k in meta}}


async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """The generate function of ``rollout.environment: {type: verifiers}``."""
    assert ctx.cfg is not None and isinstance(ctx.cfg.rollout.environment, VerifiersConfig)
    c = ctx.cfg.rollout.environment
    if inject_fault("environment"):
        raise EnvironmentFailure(f"verifiers '{c.env_id}': injected fault (TETHER_INJECT_FAULTS)")
    worker = VerifiersWorker.shared(python_of(c), c.cwd)
    async with ctx.chat_session(sample, sampling_params, tool_parser=c.tool_parser,
                                chat_template=c.chat_template) as session:
        reply = await worker.call({"op": "rollout", "env_id": c.env_id, "env_args": c.env_args,
                                   "row": verifiers_row(sample), "base_url": session.base_url, "model": "policy",
                                   "sampling_args": dict(c.sampling_args)}, c.timeout_s)
    if session.aborted:
        return sample
    if reply.get("error") and not reply.get("turns"):
        raise EnvironmentFailure(f"verifiers rollout of '{c.env_id}': {reply['error']}\n{reply.get('where', '')}")
    sample.reward = reply["reward"]
    sample.metrics.update({f"rubric/{k}": v for k, v in reply.get("metrics", {}).items()})
    sample.metrics["env_turns"] = float(reply.get("turns") or 0)
    return sample


def write_dataset(c: VerifiersConfig, split: str, out: Path) -> Path:
    """The environment's dataset (train or eval split) as prompt JSONL: prompt, answer as the label, and
    info / task / example_id as metadata."""

    async def fetch() -> list[dict]:
        worker = VerifiersWorker(python_of(c), c.cwd)
        try:
            reply = await worker.call({"op": "dataset", "env_id": c.env_id, "env_args": c.env_args, "split": split,
                                       "n": -1}, c.timeout_s)
        finally:
            if worker.proc is not None and worker.proc.returncode is None:
                worker.proc.kill()
                await worker.proc.wait()
        return reply["rows"]

    rows = asyncio.run(fetch())
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for row in rows:
            meta = {k: row[k] for k in ROW_FIELDS if row.get(k) is not None}
            f.write(json.dumps({"prompt": row["prompt"], "label": row.get("answer"), "metadata": meta}) + "\n")
    return out


def check(c: VerifiersConfig) -> None:
    """The environment's Python can import verifiers (before anything starts)."""
    found = subprocess.run([python_of(c), "-c", "import verifiers"], capture_output=True, text=True, timeout=120)
    if found.returncode != 0:
        raise ValueError(f"rollout.environment.python ({python_of(c)}) cannot import verifiers: "
                         f"{found.stderr.strip().splitlines()[-1] if found.stderr.strip() else found.returncode}")
