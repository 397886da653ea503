"""Batched autoregressive generation with a KV cache, on any HF causal LM.

Prompts are left-padded so every row's last prompt token sits in the last column; position ids
come from the attention mask so padding does not shift positions (the trainer, which right-pads,
then sees the same positions for the same tokens).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from tether.engine.sampling import SamplingParams, sample_next


@dataclass
class GenerateOutput:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length"


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


@torch.no_grad()
def generate_batch(model: nn.Module, prompts: list[list[int]], params: SamplingParams, eos_ids: set[int],
                   pad_id: int, generator: torch.Generator | None = None) -> list[GenerateOutput]:
    """Sample one response per prompt; a row stops at an eos/stop token (kept in the output)."""
    ids, mask = left_pad(prompts, pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kv = {cache_kwarg(model): DynamicCache()}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kv).logits[:, -1]
    stop = set(eos_ids) | set(params.stop_token_ids)
    stop_tensor = torch.tensor(sorted(stop), dtype=torch.long)
    n = len(prompts)
    out_ids: list[list[int]] = [[] for _ in range(n)]
    out_lp: list[list[float]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    next_pos = positions[:, -1] + 1
    for step in range(params.max_new_tokens):
        tokens, logprobs = sample_next(logits, params, generator)
        for row in (~done).nonzero().flatten().tolist():
            out_ids[row].append(int(tokens[row]))
            out_lp[row].append(float(logprobs[row]))
        done |= torch.isin(tokens, stop_tensor)
        if bool(done.all()) or step == params.max_new_tokens - 1:
            break
        # Finished rows keep decoding a pad token (their outputs are no longer recorded): a static batch.
        step_tokens = tokens.masked_fill(done, pad_id)[:, None]
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
        logits = model(input_ids=step_tokens, attention_mask=mask, position_ids=next_pos[:, None],
                       use_cache=True, **kv).logits[:, -1]
        next_pos = next_pos + 1
    return [
        GenerateOutput(ids_, lps, "stop" if ids_ and ids_[-1] in stop else "length")
        for ids_, lps in zip(out_ids, out_lp)
    ]
