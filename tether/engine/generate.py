"""A request's life in the engine, shared by the continuous batcher (batcher.py) and the server: its
output, the rules that finish it, and the batch inputs (left padding, the KV-cache argument).

Prompts are left-padded so every row's last prompt token sits in the last column; position ids
come from the attention mask so padding does not shift positions (the trainer, which right-pads,
then sees the same positions for the same tokens).

A sequence finishes, in this order of precedence, checked after each token it produces:

- "stop" at a stop token: one of the engine's eos ids (unless the row's params.ignore_eos) or of its
  params.stop_token_ids; the token is kept in the output; matched_stop is that token id.
- "stop" at a stop string: once decode(output_ids) contains one of params.stop. As in SGLang, every
  generated token is kept in output_ids (with its log-prob: ids and log-probs stay aligned, which is
  what the trainer needs), including the tokens that spell the stop string; only `text` is cut so
  it ends right before the stop string. matched_stop is that string.
- "length" once the row holds its own params.max_new_tokens tokens (a stop on the last token wins).
- "abort" when the engine is asked to stop it; it keeps the tokens it produced.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tether.engine.detokenize import IncrementalDetokenizer
from tether.engine.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class GenerateOutput:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str | None  # "stop" | "length" | "abort"; None on a partial output a stream sends before the end
    matched_stop: int | str | None = None
    """The stop token id or stop string that ended the row ("stop"); None for "length" and "abort"."""
    text: str | None = None
    """decode(output_ids) when a decoder was given, cut right before a matched stop string."""
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

    def _stop_string(self, decode: Callable[[list[int]], str] | None) -> str | None:
        """The stop string the text now contains, if any. Only the new text (and the stop length - 1
        characters before it) can hold one: an earlier match would have stopped an earlier step."""
        if self.detok is None:
            assert decode is not None  # ContinuousBatcher.new_sequence refuses stop strings without one
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


