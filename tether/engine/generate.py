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
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

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
    stop_ids = [frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos) for p in rows_params]

    ids, mask = left_pad(prompts, pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kv = {cache_kwarg(model): DynamicCache()}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kv).logits[:, -1]
    generators = list(generator) if explicit_generators else make_generators(rows_params, generator, logits.device)

    out_ids: list[list[int]] = [[] for _ in range(n)]
    out_lp: list[list[float]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    matched: list[int | str | None] = [None] * n
    next_pos = positions[:, -1] + 1
    for _step in range(max(p.max_new_tokens for p in rows_params)):
        tokens, logprobs = sample_next(logits, sample_params, generators)
        token_list, logprob_list = tokens.tolist(), logprobs.tolist()
        for row in range(n):
            if finish[row] is not None:
                continue
            token, row_params = token_list[row], rows_params[row]
            out_ids[row].append(token)
            out_lp[row].append(logprob_list[row])
            if token in stop_ids[row]:
                finish[row], matched[row] = "stop", token
            elif row_params.stop and (hit := _earliest_stop(decode(out_ids[row]), row_params.stop)) is not None:
                finish[row], matched[row] = "stop", hit
            elif len(out_ids[row]) >= row_params.max_new_tokens:
                finish[row] = "length"
        if should_abort is not None and any(f is None for f in finish):
            for row in should_abort():
                if not 0 <= row < n:
                    raise ValueError(f"should_abort returned row {row}, outside a batch of {n} rows")
                if finish[row] is None:
                    finish[row] = "abort"
        if all(f is not None for f in finish):
            break
        # Finished rows keep decoding a pad token (their outputs are no longer recorded): a static batch.
        done = torch.tensor([f is not None for f in finish], device=tokens.device)
        step_tokens = tokens.masked_fill(done, pad_id)[:, None]
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
        logits = model(input_ids=step_tokens, attention_mask=mask, position_ids=next_pos[:, None],
                       use_cache=True, **kv).logits[:, -1]
        next_pos = next_pos + 1

    outputs = []
    for row in range(n):
        text = None
        if decode is not None:
            text = decode(out_ids[row])
            if isinstance(matched[row], str):
                text = text[: text.find(matched[row])]
        outputs.append(GenerateOutput(out_ids[row], out_lp[row], finish[row] or "length", matched[row], text))
    return outputs
