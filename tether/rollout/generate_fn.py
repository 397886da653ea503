"""Custom generate functions: your code produces each sample (multi-turn, tools, agents).

slime's ``--custom-generate-function-path``, with the same shape:

    async def generate(ctx, sample, sampling_params, evaluation=False) -> Sample | list[Sample]:
        while True:
            turn = await ctx.generate_into(sample, sampling_params)   # policy tokens: loss mask 1
            call = parse_tool_call(turn.text)
            if turn.finish_reason != "stop" or call is None:
                return sample
            ctx.insert(sample, run_tool(call))                         # tool tokens: loss mask 0

``rollout.custom_generate_fn`` names it for the run; a data row's ``metadata["generate_fn"]`` names
one for that row. ``evaluation`` is passed only to a function that takes it. ``sampling_params`` is
the SGLang dict the engines take (``max_new_tokens`` is the whole response's budget; ``generate_into``
spends it across turns). ``ctx`` carries:

- ``url``: the engine serving this group (every turn of a group goes to it, so a later turn finds the
  earlier ones in its prefix cache), ``client`` (an ``httpx.AsyncClient``) for your own requests;
- ``tokenizer``, ``cfg`` (the resolved TetherConfig), ``rollout_id``, ``evaluation``, ``args`` (the
  config's ``args:``), ``models`` (served models by name: a judge, a teacher; tether/rollout/served.py);
- ``generate(input_ids, sampling_params)``: one /generate call, returning a ``Generation`` (ids,
  log-probs, text, finish reason, weight version); ``generate_into(sample, sampling_params)``: the next
  turn of ``sample``'s response, appended; ``insert(sample, text | ids)``: inserted tokens.

Every call carries the sample's request id, so the driver's abort (dynamic sampling, partial rollout)
reaches it; after an abort, ``generate`` answers at once with ``finish_reason == "abort"``. A sample
carried over by partial rollout comes back with its response so far: ``generate_into`` continues it.
The first call of a sample uses the seed the built-in path would, so a single-turn function samples
the same tokens as the default.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import httpx

from tether.config import TetherConfig
from tether.config.raw import resolve_spec
from tether.engine.backends import request_fields
from tether.engine.sampling import SamplingParams
from tether.importing import load_function
from tether.rollout.failures import EngineReplyError, FailurePolicy, classify
from tether.rollout.fleet import sampling_payload
from tether.progress import report_progress
from tether.run.faults import CURRENT_SAMPLE, SampleCall
from tether.sample import STATUS_OF_FINISH, Sample, SampleError
from tether.served import MODELS as SERVED_MODELS

FIELD = "rollout.custom_generate_fn"
ROW_KEY = "generate_fn"


class GenerateLoadError(ValueError):
    """A generate function named by the config or a data row cannot be loaded."""


class GenerateError(RuntimeError):
    """A generate function raised, or returned something that cannot be trained on; names the sample."""


@dataclass
class Generation:
    """One /generate call's result."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    """"stop", "length" or "abort"."""
    weight_version: int
    version_spans: list[list[int]] | None = None
    """[[version, tokens], ...] when weights were updated in place during the call."""
    matched_stop: str | int | None = None
    """What ended a "stop": the stop string or stop token id matched (None: the end-of-sequence token)."""

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


class GenerateContext:
    """What a generate function gets besides its sample (one per sample and call)."""

    def __init__(self, *, url: str, client: httpx.AsyncClient, tokenizer, cfg: TetherConfig | None, rollout_id: int,
                 evaluation: bool, rid: str, seed: int, is_cut: Callable[[], bool], timeout_s: float,
                 budget: int | None = None):
        """``budget``: the response's max_new_tokens (what ``insert`` may fill); None: unbounded."""
        self.url, self.client, self.tokenizer, self.cfg = url, client, tokenizer, cfg
        self.rollout_id, self.evaluation = rollout_id, evaluation
        self.rid, self._seed, self._is_cut, self._timeout_s = rid, seed, is_cut, timeout_s
        self.budget = budget
        self.calls = 0
        self._fields = request_fields(cfg) if cfg is not None else {}  # the adapter SGLang serves the policy as
        self.args: dict = dict(cfg.args) if cfg is not None else {}
        """The config's ``args:``: this function's own settings."""
        self.models = SERVED_MODELS
        """The run's served models by name (``served_models:``; tether/rollout/served.py)."""

    async def generate(self, input_ids: list[int], sampling_params: dict) -> Generation:
        """One /generate call on this group's engine, with log-probs."""
        if self._is_cut():  # the rollout has its groups: no new work
            return Generation([], [], "", "abort", -1)
        # Call k of a sample has its own seed; the first is the built-in path's.
        seed = self._seed if self.calls == 0 else (self._seed * 1_000_033 + self.calls) % (1 << 62)
        self.calls += 1
        payload = {"input_ids": [int(t) for t in input_ids], "sampling_params": {**sampling_params, "sampling_seed": seed},
                   "rid": self.rid, "return_logprob": True, **self._fields}
        reply = await self.client.post(f"{self.url}/generate", json=payload, timeout=self._timeout_s)
        if reply.status_code != 200:
            raise EngineReplyError(f"engine {self.url} answered {reply.status_code} to /generate: {reply.text[:500]}")
        report_progress()
        out = reply.json()
        meta = out["meta_info"]
        finish = meta["finish_reason"]
        return Generation(list(out["output_ids"]), [lp for lp, _, _ in meta["output_token_logprobs"]], out["text"],
                          finish["type"], int(meta["weight_version"]), meta.get("weight_version_spans"),
                          finish.get("matched"))

    async def generate_into(self, sample: Sample, sampling_params: dict, stop: Iterable[str] = ()) -> Generation:
        """Generate the next part of ``sample``'s response from its prompt and response so far and append
        it (trained on). ``sampling_params["max_new_tokens"]`` bounds the whole response: with nothing
        left the sample is truncated without a call. ``stop``: strings that end this turn besides
        ``sampling_params["stop"]`` (a tool call's closing delimiter, "</tool_call>"); the turn's text
        keeps the one matched (``matched_stop``), as its tokens do."""
        left = int(sampling_params["max_new_tokens"]) - sample.response_length
        if left <= 0:  # no call: no span
            sample.finish_reason, sample.status = "length", "truncated"
            return Generation([], [], "", "length", sample.weight_versions[-1] if sample.weight_versions else -1)
        params = {**sampling_params, "max_new_tokens": left}
        if stop:
            given = params.get("stop") or []
            params["stop"] = [*([given] if isinstance(given, str) else given), *stop]
        gen = await self.generate(sample.prompt_ids + sample.response_ids, params)
        # The text as the tokens spell it: the engine cuts a matched stop string out of its text, but
        # the tokens keep it, the next turn follows it, and a parser looking for the delimiter finds it.
        text = self.tokenizer.decode(gen.ids, skip_special_tokens=True)
        sample.add_reply(gen.ids, gen.logprobs, text, gen.finish_reason, gen.weight_version, gen.version_spans)
        return dataclasses.replace(gen, text=text)

    def chat_session(self, sample: Sample, sampling_params: dict, *, tools: list[dict] | None = None,
                     tool_parser="hermes", chat_template: str | None = None):
        """An OpenAI-compatible chat endpoint for ``sample``'s agent (``async with ... as session``, then
        ``base_url=session.base_url``): every turn is recorded in the sample with the engine's exact tokens
        (tether/rollout/chat_session.py). ``tool_parser``: "hermes", a module:fn / file.py:fn spec, or a
        callable from reply text to (content, [{"name", "arguments"}]); ``chat_template`` overrides the
        tokenizer's."""
        from tether.rollout.chat_server import ChatServer  # FastAPI: loaded by the runs that chat
        from tether.rollout.chat_session import ChatSession

        return ChatSession(self, sample, sampling_params, tools=tools, tool_parser=tool_parser,
                           chat_template=chat_template, server=ChatServer.shared())

    def insert(self, sample: Sample, content: str | list[int]) -> list[int]:
        """Append inserted tokens (text is tokenized without special tokens): in the input of later turns,
        not trained on. They count against the response budget: what does not fit is cut off and the
        sample ends truncated. Returns the ids inserted."""
        ids = self.tokenizer.encode(content, add_special_tokens=False) if isinstance(content, str) else list(content)
        left = len(ids) if self.budget is None else max(0, self.budget - sample.response_length)
        cut = len(ids) > left
        if cut:
            ids = ids[:left]
        text = content if isinstance(content, str) and not cut else self.tokenizer.decode(ids)
        sample.add_inserted(ids, text)
        if cut:
            sample.finish_reason, sample.status = "length", "truncated"
        return ids


def takes_evaluation(fn: Callable) -> bool:
    """Whether ``fn`` accepts an ``evaluation`` keyword (by name, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "evaluation" and p.kind != p.POSITIONAL_ONLY or p.kind == p.VAR_KEYWORD for p in params)


class CustomGenerate:
    """The generate functions of a run, loaded once: the config's and those data rows name."""

    def __init__(self, default: str | None, rows: Iterable[tuple[str, str]] = (), tokenizer=None,
                 cfg: TetherConfig | None = None, policy: FailurePolicy | None = None, field: str = FIELD):
        """``rows``: (spec, "file:line") of each data row naming its own function (see ``resolve_rows``);
        ``policy``: retries and masking of failed samples (the config's ``rollout.failures`` by default);
        ``field``: the config field that named ``default``, in errors (rollout.environment for an environment's)."""
        self.default, self.tokenizer, self.cfg, self.field = default, tokenizer, cfg, field
        self.policy = policy or (FailurePolicy.from_config(cfg.rollout.failures) if cfg is not None else FailurePolicy())
        self.fns: dict[str, Callable] = {}
        if default:
            self.fns[default] = _load(default, field)
        for spec, where in rows:
            if spec not in self.fns:
                self.fns[spec] = _load(spec, f"{where}: metadata.{ROW_KEY}")
        self.takes_evaluation = {spec: takes_evaluation(fn) for spec, fn in self.fns.items()}

    @staticmethod
    def resolve_rows(rows, path: str) -> list[tuple[str, str]]:
        """(spec, "file:line") of every loaded prompt row naming its own generate function; the spec is
        resolved in the row itself too."""
        found = []
        for row in rows:
            spec = row_spec(row.metadata, path)
            if spec:
                row.metadata[ROW_KEY] = spec
                found.append((spec, f"{path}:{row.line}"))
        return found

    def spec_for(self, sample: Sample) -> str | None:
        """The function that generates this sample: its row's, else the run's (None: the built-in path)."""
        spec = sample.metadata.get(ROW_KEY) if isinstance(sample.metadata, dict) else None
        return spec or self.default

    async def generate_group(self, spec: str, samples: list[Sample], params: SamplingParams, url: str,
                             client: httpx.AsyncClient, seeds: list[int], rids: list[str],
                             is_cut: Callable[[], bool], timeout_s: float, evaluation: bool) -> list[Sample]:
        """Run the function on every sample of a group at once; returns the group's samples (a function
        may return several for one)."""
        out = await asyncio.gather(*(
            self._one(spec, s, sampling_payload(params, seed), url, client, rid, seed, is_cut, timeout_s, evaluation)
            for s, seed, rid in zip(samples, seeds, rids)))
        return [s for produced in out for s in produced]

    async def _one(self, spec, sample, sampling_params, url, client, rid, seed, is_cut, timeout_s,
                   evaluation) -> list[Sample]:
        """One sample by its function: tried again from where it started while its failure's kind has
        attempts left (tether/rollout/failures.py); a sample that still fails comes back failed."""
        if sample.status in ("completed", "truncated") or sample.failed:  # carried over done (partial rollout)
            return [sample]
        # Its state at the start, for a retry (none can be when no kind is retried).
        start = copy.deepcopy(sample) if self.policy.max_attempts > 1 and self.policy.retry else None
        retries: list[str] = []
        while True:
            trial = sample if start is None or not retries else copy.deepcopy(start)
            token = CURRENT_SAMPLE.set(SampleCall((sample.rollout_id, sample.prompt_index, sample.sample_index),
                                                  len(retries) + 1))
            try:
                produced = await self._attempt(spec, trial, sampling_params, url, client, rid, seed, is_cut,
                                               timeout_s, evaluation)
                failure = None
            except GenerateError as err:
                if lost_connection(err) is not None:  # the group moves to another engine (group_runner.py)
                    raise
                failure, produced = (classify(err), str(err)), [trial]
            finally:
                CURRENT_SAMPLE.reset(token)
            if failure is not None and len(retries) + 1 < self.policy.attempts(failure[0]):
                retries.append(failure[0])
                continue
            for kind in retries:
                produced[0].note_retry(kind)
            if failure is not None:
                trial.status = "failed"
                trial.fail(failure[0], failure[1], len(retries) + 1)
            return produced

    async def _attempt(self, spec, sample, sampling_params, url, client, rid, seed, is_cut, timeout_s,
                       evaluation) -> list[Sample]:
        ctx = GenerateContext(url=url, client=client, tokenizer=self.tokenizer, cfg=self.cfg,
                              rollout_id=sample.rollout_id, evaluation=evaluation, rid=rid, seed=seed,
                              is_cut=is_cut, timeout_s=timeout_s, budget=int(sampling_params["max_new_tokens"]))
        kwargs = {"evaluation": evaluation} if self.takes_evaluation[spec] else {}
        try:
            result = self.fns[spec](ctx, sample, sampling_params, **kwargs)
            if inspect.isawaitable(result):
                result = await result
        except GenerateError as err:
            raise GenerateError(f"{self._field(spec)} '{spec}' on {sample.describe()}: {err}") from err
        except Exception as err:
            raise GenerateError(f"{self._field(spec)} '{spec}' raised {type(err).__name__}: {err}{_where(err)} "
                                f"({sample.describe()})") from err
        produced = result if isinstance(result, list) else [result]
        if not produced or not all(isinstance(s, Sample) for s in produced):
            raise GenerateError(f"{self._field(spec)} '{spec}' returned {result!r:.200} for {sample.describe()}; expected a "
                                "Sample or a non-empty list of Samples")
        for s in produced:
            if s.status == "pending":
                s.status = STATUS_OF_FINISH.get(s.finish_reason, "completed")
            try:
                s.check_aligned()
            except SampleError as err:
                raise GenerateError(f"{self._field(spec)} '{spec}' returned a sample that cannot be trained on: {err}") from None
        return produced

    def _field(self, spec: str) -> str:
        return self.field if spec == self.default else f"metadata.{ROW_KEY}"


def lost_connection(err: BaseException) -> BaseException | None:
    """The broken connection to the engine behind ``err`` (not a timeout: the engine is gone, not the
    sample), or None."""
    cause = err.__cause__
    while isinstance(cause, GenerateError) and cause.__cause__ is not None:
        cause = cause.__cause__
    return cause if isinstance(cause, httpx.TransportError) and not isinstance(cause, httpx.TimeoutException) else None


def row_spec(metadata, data_path: str) -> str | None:
    """A data row's own generate function, a relative ``file.py:fn`` made absolute against the data
    file's folder; None when the row names none."""
    spec = metadata.get(ROW_KEY) if isinstance(metadata, dict) else None
    return resolve_spec(spec, Path(data_path).resolve().parent) if spec else None


def _load(spec: str, field: str) -> Callable:
    try:
        return load_function(spec, "generate function", GenerateLoadError)
    except GenerateLoadError as err:
        raise GenerateLoadError(f"{field}: {err}") from None


def _where(err: Exception) -> str:
    """' at file:line' of the frame that raised (the user's code, usually)."""
    frames = traceback.extract_tb(err.__traceback__)
    return f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def group_tokens(samples: list[Sample], params: SamplingParams) -> int:
    """A group's expected KV work, for choosing its engine."""
    return sum(len(s.prompt_ids) + params.max_new_tokens for s in samples)
