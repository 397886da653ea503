"""Request and response shapes of the engine's HTTP API, compatible with SGLang's where rollout code
uses them (`/generate` with `input_ids` or `text`, `sampling_params`, `return_logprob`; responses with
`text`, `output_ids` and `meta_info`), so the same client code drives every backend.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tether.engine.generate import GenerateOutput
from tether.engine.sampling import SamplingParams


class Strict(BaseModel):
    # Unknown fields are errors: a misspelt sampling parameter must not be silently ignored. NaN and
    # infinities are refused where they are parsed (a temperature of inf would sample uniformly).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SamplingParamsIn(Strict):
    max_new_tokens: int = Field(128, ge=0)
    """0 only with logprob_start_len: score the prompt, generate nothing."""
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    def to_params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              max_new_tokens=self.max_new_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos, stop=stop, seed=self.sampling_seed)


class GenerateIn(Strict):
    """One request, or a batch when `text` / `input_ids` is a list of prompts."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] = SamplingParamsIn()
    return_logprob: bool = False
    logprob_start_len: int | list[int] = -1
    """SGLang's: from which prompt position to return input_token_logprobs (the log-prob of each prompt
    token after the tokens before it; None for position 0). This engine computes them for scoring
    requests (max_new_tokens 0 with return_logprob: a distillation teacher's, a reward model's); -1: none."""
    rid: str | list[str] | None = None
    stream: bool = False
    # Fields SGLang's clients and sglang-router send with their defaults; accepted so that they can
    # talk to this engine, refused when asked for something this engine does not do.
    model: str | None = None
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    no_logs: bool = False
    return_hidden_states: bool = False
    return_entropy: bool = False
    return_bytes: bool = False
    background: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateIn:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        unsupported = [name for name in ("return_hidden_states", "return_entropy", "return_bytes",
                                         "background") if getattr(self, name)]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}=true is not supported by this engine")
        params = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]
        zero = [p.max_new_tokens == 0 for p in params]
        if self.scoring:
            if not self.return_logprob or not all(zero):
                raise ValueError("logprob_start_len asks for the prompt's log-probs, which this engine computes for "
                                 "scoring requests: return_logprob: true with max_new_tokens: 0 in every sampling_params")
        elif any(zero):
            raise ValueError("max_new_tokens: 0 generates nothing: give logprob_start_len (and return_logprob) to "
                             "score the prompt")
        return self

    @property
    def scoring(self) -> bool:
        """A request for the prompt's log-probs only (no generation)."""
        starts = self.logprob_start_len if isinstance(self.logprob_start_len, list) else [self.logprob_start_len]
        return any(start >= 0 for start in starts)

    def logprob_starts(self, n: int) -> list[int]:
        starts = self.logprob_start_len if isinstance(self.logprob_start_len, list) else [self.logprob_start_len] * n
        if len(starts) != n:
            raise ValueError(f"{n} prompts but {len(starts)} logprob_start_len values")
        return [max(0, start) for start in starts]

    @property
    def is_batch(self) -> bool:
        ids = self.input_ids
        return isinstance(self.text, list) or (ids is not None and len(ids) > 0 and isinstance(ids[0], list))

    def prompts(self, tokenizer: Any) -> list[list[int]]:
        if self.input_ids is not None:
            # is_batch tells which of the two shapes input_ids has.
            if self.is_batch:
                return [list(x) for x in cast("list[list[int]]", self.input_ids)]
            return [list(cast("list[int]", self.input_ids))]
        texts = self.text if isinstance(self.text, list) else [self.text]
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def per_prompt(self, n: int) -> tuple[list[SamplingParamsIn], list[str | None]]:
        params = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params] * n
        rids: list[str | None] = (list(self.rid) if isinstance(self.rid, list) else [self.rid] * n if n == 1
                                  else [None] * n)
        if len(params) != n or len(rids) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling_params and {len(rids)} rids")
        return params, rids


def finish_reason(out: GenerateOutput) -> dict:
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    if out.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return {"type": "stop", "matched": out.matched_stop}


def response(out: GenerateOutput, rid: str, prompt_len: int, text: str, return_logprob: bool, version: int) -> dict:
    meta = {"id": rid, "finish_reason": finish_reason(out), "prompt_tokens": prompt_len,
            "completion_tokens": len(out.output_ids), "weight_version": version}
    if out.weight_spans and len(out.weight_spans) > 1:  # updated in place mid-request: who sampled what
        meta["weight_version_spans"] = out.weight_spans
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(out.output_logprobs, out.output_ids)]
    return {"text": text, "output_ids": out.output_ids, "meta_info": meta}


def scored(ids: list[int], logprobs: list[float | None], start: int, rid: str | None, version: int) -> dict:
    """A scoring request's reply, SGLang's shape: input_token_logprobs from position ``start``."""
    meta = {"id": rid or "", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
            "completion_tokens": 0, "weight_version": version, "output_token_logprobs": [],
            "input_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs[start:], ids[start:])]}
    return {"text": "", "output_ids": [], "meta_info": meta}


def openai_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def include_usage(stream_options: dict | None) -> bool:
    """Whether a streaming OpenAI client asked for the usage chunk (stream_options.include_usage)."""
    return bool((stream_options or {}).get("include_usage"))


class TagsIn(Strict):
    tags: list[str] | None = None


class PauseIn(Strict):
    """/pause_generation as SGLang takes it. in_place (and retract, the same to a client): running
    requests hold and continue at /continue_generation; abort: they are aborted first. SGLang's own
    default is abort; tether always sends in_place, and without a body this engine holds."""

    mode: Literal["abort", "retract", "in_place"] = "in_place"


class AbortIn(Strict):
    rid: str | None = None
    abort_all: bool = False


class UpdateWeightsIn(Strict):
    serialized_named_tensors: str
    """base64 of a safetensors file holding the named tensors (no pickle on the wire)."""
    weight_version: int | None = None
    flush_cache: bool = True


class InitGroupIn(Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "tether-weights"
    backend: Literal["gloo", "nccl"] = "gloo"


class UpdateDistributedIn(Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "tether-weights"
    weight_version: int | None = None
    """Set on the last call of an update: the version is committed after loading its tensors."""
    flush_cache: bool = True


class CompletionIn(BaseModel):
    """OpenAI /v1/completions (the fields agent frameworks send; others are accepted and ignored)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    logprobs: int | None = None


class ChatIn(BaseModel):
    """OpenAI /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str | None = None
    messages: list[dict]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    logprobs: bool = False
