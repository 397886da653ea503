"""The trainer's LM head at real vocabulary sizes: log-probs from the final hidden states, a chunk of
tokens at a time, and only where a response is scored.

An HF causal LM's forward returns logits for every position: [B, L, V] float32, which for 8 samples of
512 tokens at Qwen's 151,936-token vocabulary is 2.5 GB, kept for backward with a copy of the same size
for the softmax. The trainer needs the log-prob of one token per position, and only at response
positions. So for one forward the LM head's own ``forward`` is replaced: it receives the final hidden
states, keeps the response positions (prompt positions cost the full head matmul and were thrown away),
and computes log-probs (and entropy) with ``algorithms.logprobs.head_logprobs``, which holds one
chunk's [chunk, V] logits at a time and recomputes them in backward. Everything still runs inside the
model's own forward, so FSDP2's hooks (gathering the root's parameters, reducing their gradients) work
as they do for a plain forward, and tied embeddings get the head's gradient as before.

What a model does to its logits after the head (Gemma 2/3's soft-capping, Granite's and Cohere's
scaling) is switched off for that forward and applied in the chunk instead. A model that does
something else would get wrong log-probs, so the first use checks the chunked path against the plain
one on a short input, and a model that disagrees keeps the plain path (with a warning).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

from tether.algorithms.logprobs import head_logprobs, logprobs_and_entropy
from tether.trainer import shared_prefix
from tether.trainer.batch import MicroBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_CHECKED = "_tether_chunked_head_ok"


def chunk_tokens(model: PreTrainedModel, chunk_mb: float) -> int:
    """Positions per chunk so that one chunk's float32 logits take about ``chunk_mb`` MB."""
    vocab = model.get_output_embeddings().weight.shape[0]
    return max(1, int(chunk_mb * 2**20 // (4 * vocab)))


@contextmanager
def _head_transforms_off(model: PreTrainedModel) -> Iterator[tuple[float | None, float]]:
    """Switch off the model's own post-head logit transforms for one forward; yields (softcap, scale)
    for the chunk to apply instead."""
    config = model.config
    softcap = getattr(config, "final_logit_softcapping", None)
    scaling = getattr(config, "logits_scaling", None)  # Granite divides by it
    logit_scale = getattr(model, "logit_scale", None)  # Cohere multiplies by it
    scale = (1.0 / scaling if scaling else 1.0) * (float(logit_scale) if logit_scale is not None else 1.0)
    try:
        if softcap is not None:
            config.final_logit_softcapping = None
        if scaling:
            config.logits_scaling = 1.0
        if logit_scale is not None:
            # Cohere's logit_scale is a plain float; nn.Module types attributes it does not declare as
            # parameters or submodules.
            model.logit_scale = 1.0  # type: ignore[assignment]
        yield softcap, scale
    finally:
        if softcap is not None:
            config.final_logit_softcapping = softcap
        if scaling:
            config.logits_scaling = scaling
        if logit_scale is not None:
            model.logit_scale = logit_scale


def model_inputs(model: PreTrainedModel, mb: MicroBatch) -> dict:
    """The forward's keyword arguments on the model's device: ids, positions, and the 2-D mask or the
    shared layout's 4-D one (built there: a flex BlockMask is not moved by FSDP as tensors are)."""
    device: torch.device = model.get_input_embeddings().weight.device  # type: ignore[assignment]
    mask = (mb.attention_mask if mb.attention_layout is None else shared_prefix.attention_mask(model, mb, device))
    return dict(input_ids=mb.input_ids.to(device), attention_mask=None if mask is None else mask.to(device),
                position_ids=None if mb.position_ids is None else mb.position_ids.to(device), use_cache=False)


def chunked_forward(model: PreTrainedModel, mb: MicroBatch, temperature: float, entropy: str,
                    tokens_per_chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, L-1] log-probs (and entropies) at the micro-batch's scored positions (0 elsewhere)."""
    head = model.get_output_embeddings()
    rows, cols, at = mb.prediction_index()

    def scored_head(hidden: torch.Tensor) -> torch.Tensor:
        h = hidden[rows.to(hidden.device), cols.to(hidden.device)]  # [N, H]
        lp, ent = head_logprobs(h, head.weight, mb.targets[at].to(hidden.device), temperature, bias=head.bias,
                                chunk_tokens=tokens_per_chunk, entropy=entropy, softcap=softcap, scale=scale)
        out = torch.zeros((*mb.targets.shape, 2), dtype=torch.float32, device=hidden.device)
        values = torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)], dim=-1)
        return out.index_put(at, values)  # stands in for the logits in the model's output

    with _head_transforms_off(model) as (softcap, scale):
        head.forward = scored_head
        try:
            out = model(**model_inputs(model, mb)).logits
        finally:
            del head.forward
    ent = None if entropy == "none" else out[..., 1] if entropy == "grad" else out[..., 1].detach()
    return out[..., 0], ent


def plain_forward(model: PreTrainedModel, mb: MicroBatch, temperature: float,
                  entropy: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole [B, L, V] logits at once (the reference the chunked path is checked against)."""
    logits = mb.at_predictions(model(**model_inputs(model, mb)).logits)
    return logprobs_and_entropy(logits, mb.targets.to(logits.device), temperature, entropy)


@torch.no_grad()
def chunked_head_agrees(model: PreTrainedModel) -> bool:
    """Whether the chunked head gives the plain path's log-probs on a short input, checked once per model.
    Under FSDP the forwards gather parameters: every rank runs this at the same point (its first
    forward_logprobs), on the same input, and reaches the same answer."""
    ok = getattr(model, _CHECKED, None)
    if ok is None:
        device = model.get_output_embeddings().weight.device
        vocab = model.get_output_embeddings().weight.shape[0]
        ids = (torch.arange(7, device=device) * 7919 % vocab)[None]
        mb = MicroBatch(ids, torch.ones_like(ids), ids[:, 1:], torch.ones(1, 6), torch.zeros(1, 6), [0], [(0, 0)])
        want, _ = plain_forward(model, mb, 1.0, "none")
        got, _ = chunked_forward(model, mb, 1.0, "none", 2)
        ok = bool(torch.allclose(got, want, atol=1e-3, rtol=1e-4))
        if not ok:
            warnings.warn(f"{type(model).__name__}: the chunked LM head disagrees with the model's own logits "
                          "(a post-head transform tether does not know): computing whole logits instead",
                          stacklevel=2)
        setattr(model, _CHECKED, ok)
    return ok
