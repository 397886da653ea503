"""Batched autoregressive generation with a KV cache, on any HF causal LM.

Prompts are left-padded so every row's last prompt token sits in the last column; position ids
come from the attention mask so padding does not shift positions (the trainer, which right-pads,
then sees the same positions for the same tokens).

One batch may mix requests with different sampling settings (one SamplingParams per prompt). A row
finishes, in this order of precedence, checked after each token it produces:

- "stop" at a stop token: one of the engine's eos ids (unless the row's params.ignore_eos) or of its
  params.stop_token_ids; the token is kept in the output; matched_stop is that token id.
- "stop" at a stop string: once decode(output_ids) contains one of params.stop. As in SGLang, every
  generated token is kept in output_ids (with its log-prob: ids and log-probs stay aligned, which is
  what the trainer needs), including the tokens that spell the stop string; only `text` is cut so
  it ends right before the stop string. matched_stop is that string.
- "length" once the row holds its own params.max_new_tokens tokens (a stop on the last token wins).
- "abort" when should_abort names it (see generate_batch); it keeps the tokens it produced.

A finished row keeps decoding a pad token (its outputs are no longer recorded: a static batch); the
loop ends as soon as every row is finished.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from tether.engine.detokenize import IncrementalDetokenizer
from tether.engine.sampling import SamplingParams, sample_next

FINISH_REASONS = ("stop", "length", "abort")

Generators = torch.Generator | None | Sequence[torch.Generator | None]


@dataclass
class GenerateOutput:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    """The stop token id or stop string that ended the row ("stop"); None for "length" and "abort"."""
    text: str | None = None
    """decode(output_ids) when generate_batch was given a decoder, cut right before a matched stop string."""
    weight_spans: list[list[int]] | None = None
    """[[weight version, tokens], ...] in order: which weights sampled which tokens (more than one span
    when the weights were updated while the request was paused in place)."""


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {row} is empty: generation needs at least one prompt token")
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def cache_kwarg(model: nn.Module) -> str:
    """Newer transformers name the KV-cache argument `cache`; older ones `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def make_generators(params_list: Sequence[SamplingParams], default_generator: torch.Generator | None = None,
                    device: torch.device | str | None = None) -> torch.Generator | None | list[torch.Generator | None]:
    """The generator(s) a batch draws from, honouring per-request seeds.

    No request has a seed: ``default_generator`` itself (the whole batch draws from it in one call,
    exactly as before seeds existed). Otherwise one entry per row: a fresh generator on ``device``
    seeded with the row's params.seed (rows with equal seeds get separate generators, so they draw
    the same tokens as each would alone), or ``default_generator`` (shared, possibly None: the global
    RNG) for rows without a seed. ``device`` defaults to the default generator's device, else CPU.
    """
    if all(p.seed is None for p in params_list):
        return default_generator
    if device is None:
        device = default_generator.device if default_generator is not None else "cpu"
    return [default_generator if p.seed is None else torch.Generator(device=device).manual_seed(p.seed)
            for p in params_list]


def _earliest_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """The stop string that occurs first in text (the first listed on a tie), or None."""
    best, best_pos = None, len(text) + 1
    for stop in stops:
        pos = text.find(stop)
        if pos != -1 and pos < best_pos:
            best, best_pos = stop, pos
    return best


@dataclass
class Sequence:
    """One request in flight: its prompt, what it produced so far, and the rules that finish it."""

    key: Any  # the caller's handle for this request
    prompt: list[int]
    params: SamplingParams
    seed: int  # this request's noise stream: its tokens depend on it, not on its batch-mates
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None
    version_spans: list[list[int]] = field(default_factory=list)  # [[weight version, tokens], ...]
    detok: IncrementalDetokenizer | None = None  # the response's text so far, for stop strings

    @property
    def next_position(self) -> int:
        # The pending (last sampled) token sits at this position once fed.
        return len(self.prompt) + len(self.output_ids) - 1

    def record(self, token: int, logprob: float, decode: Callable[[list[int]], str] | None, version: int = 0) -> None:
        """Append a sampled token (sampled by weight ``version``) and decide whether the sequence is
        finished (module docstring)."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1][1] += 1
        else:
            self.version_spans.append([version, 1])
        if token in self.stop_ids:
            self.finish_reason, self.matched = "stop", token
        elif self.params.stop and (hit := self._stop_string(decode)) is not None:
            self.finish_reason, self.matched = "stop", hit
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"

    def _stop_string(self, decode: Callable[[list[int]], str]) -> str | None:
        """The stop string the text now contains, if any. Only the new text (and the stop length - 1
        characters before it) can hold one: an earlier match would have stopped an earlier step."""
        if self.detok is None:
            self.detok = IncrementalDetokenizer(decode)
        new = self.detok.update(self.output_ids)
        if not new:
            return None
        reach = len(new) + max(len(s) for s in self.params.stop) - 1
        return _earliest_stop(self.detok.text[-reach:], self.params.stop)

    def output(self, decode: Callable[[list[int]], str] | None) -> GenerateOutput:
        text = None
        if decode is not None:
            text = decode(self.output_ids)
            if isinstance(self.matched, str):
                text = text[: text.find(self.matched)]
        return GenerateOutput(self.output_ids, self.output_logprobs, self.finish_reason or "length", self.matched, text,
                              [list(span) for span in self.version_spans])


@torch.no_grad()
def generate_batch(model: nn.Module, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
                   eos_ids: Iterable[int], pad_id: int, generator: Generators = None, *,
                   should_abort: Callable[[], Iterable[int]] | None = None,
                   decode: Callable[[list[int]], str] | None = None) -> list[GenerateOutput]:
    """Sample one response per prompt (see the module docstring for when a row finishes).

    params: one SamplingParams for all prompts or one per prompt. generator: a generator (or None,
    the global RNG) passed through `make_generators` with the params' seeds, or an explicit list with
    one generator (or None) per prompt, used as given (seeds are then not consulted).
    should_abort: called once per decode step, after that step's tokens are recorded and the
    stop/length checks are done, and only while some row is still running; it returns the row
    indices to abort now. Such a row finishes "abort" and keeps its tokens: a row named at the call
    of step k (0-based) holds k + 1 tokens. Rows already finished are left as they are.
    decode: token ids -> text; required when any params.stop is set; when given, every output's
    `text` is filled.
    """
    n = len(prompts)
    if isinstance(params, SamplingParams):
        rows_params = [params] * n
    else:
        rows_params = list(params)
        if len(rows_params) != n:
            raise ValueError(f"params: got {len(rows_params)} SamplingParams for {n} prompts")
    explicit_generators = isinstance(generator, (list, tuple))
    if explicit_generators and len(generator) != n:
        raise ValueError(f"generator: got {len(generator)} generators for {n} prompts")
    if decode is None and any(p.stop for p in rows_params):
        raise ValueError("params.stop (stop strings) needs a decode function to detokenize the outputs")
    if n == 0:
        return []
    # One object when every row shares params: sample_next then takes the historical path.
    sample_params = rows_params[0] if len(set(rows_params)) == 1 else rows_params

    eos = frozenset(eos_ids)
    seqs = [Sequence(row, list(prompt), p, p.seed or 0, frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos))
            for row, (prompt, p) in enumerate(zip(prompts, rows_params))]

    ids, mask = left_pad(prompts, pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kv = {cache_kwarg(model): DynamicCache()}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kv).logits[:, -1]
    generators = list(generator) if explicit_generators else make_generators(rows_params, generator, logits.device)

    next_pos = positions[:, -1] + 1
    for _step in range(max(p.max_new_tokens for p in rows_params)):
        tokens, logprobs = sample_next(logits, sample_params, generators)
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            if seq.finish_reason is None:
                seq.record(token, logprob, decode)
        if should_abort is not None and any(s.finish_reason is None for s in seqs):
            for row in should_abort():
                if not 0 <= row < n:
                    raise ValueError(f"should_abort returned row {row}, outside a batch of {n} rows")
                if seqs[row].finish_reason is None:
                    seqs[row].finish_reason = "abort"
        if all(s.finish_reason is not None for s in seqs):
            break
        # Finished rows keep decoding a pad token (their outputs are no longer recorded): a static batch.
        done = torch.tensor([s.finish_reason is not None for s in seqs], device=tokens.device)
        step_tokens = tokens.masked_fill(done, pad_id)[:, None]
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
        logits = model(input_ids=step_tokens, attention_mask=mask, position_ids=next_pos[:, None],
                       use_cache=True, **kv).logits[:, -1]
        next_pos = next_pos + 1
    return [seq.output(decode) for seq in seqs]
