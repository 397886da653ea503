"""Per-token log-probabilities and entropies from raw logits.

Both the trainer (on shifted logits: ``logits[:, :-1]`` predicts
``tokens[:, 1:]``) and the inference engine (reporting the log-prob of each
sampled token) call these functions, so the numerics live in exactly one place:
logits are cast to float32, divided by the temperature, and reduced with
``logsumexp``. Calling them on the same inputs in either place gives the same
numbers, which keeps the PPO importance ratio at exactly 1 when the policy has
not moved.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_logprobs", "entropy_from_logits", "logprobs_and_entropy", "head_logprobs"]


def _check_temperature(temperature: float) -> None:
    # `not t > 0` also rejects NaN.
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _scaled_float32(logits: Tensor, temperature: float) -> Tensor:
    """float32 view/copy of ``logits / temperature``.

    Copies only when needed: float32 logits at temperature 1 are used as-is.
    """
    x = logits if logits.dtype == torch.float32 else logits.float()
    if temperature != 1.0:
        x = x / temperature
    return x


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, L, V]`` (any leading dims ``[..., V]``), any float dtype.
        targets: ``[B, L]`` integer token ids, same leading shape as ``logits``.
            Every id must be a valid vocabulary index (no ``-100`` padding;
            mask those positions downstream instead).
        temperature: sampling temperature, ``> 0``.

    Returns:
        float32 ``[B, L]`` log-probs; differentiable w.r.t. ``logits``.
    """
    _check_temperature(temperature)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without the "
            f"vocab dim {tuple(logits.shape[:-1])}"
        )
    x = _scaled_float32(logits, temperature)
    # log p(t) = x_t - logsumexp(x): only a [B, L] normaliser is materialised,
    # not a second [B, L, V] log_softmax tensor.
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - lse


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at each position, in float32.

    Args:
        logits: ``[B, L, V]`` (any leading dims ``[..., V]``), any float dtype.
        temperature: sampling temperature, ``> 0``.

    Returns:
        float32 ``[B, L]`` entropies in nats; differentiable w.r.t. ``logits``.
        Tokens with ``-inf`` logits (banned tokens) contribute 0, not NaN.
    """
    _check_temperature(temperature)
    x = _scaled_float32(logits, temperature)
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    # H = -sum p log p, with the convention 0 * log 0 = 0; filling the -inf
    # entries keeps both the value and the gradient NaN-free.
    plogp = p * logp.masked_fill(torch.isneginf(logp), 0.0)
    return -plogp.sum(dim=-1)


def logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float,
                         entropy: str = "none") -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` and, by ``entropy``, the entropy at each position: "grad" (differentiable),
    "metric" (computed without a graph: logged, not optimised) or "none" (None)."""
    logprobs = token_logprobs(logits, targets, temperature)
    if entropy == "grad":
        return logprobs, entropy_from_logits(logits, temperature)
    if entropy == "metric":
        with torch.no_grad():
            return logprobs, entropy_from_logits(logits.detach(), temperature)
    return logprobs, None


def head_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, *,
                  bias: Tensor | None = None, chunk_tokens: int = 1024, entropy: str = "none",
                  softcap: float | None = None, scale: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of ``targets`` under the LM head, ``chunk_tokens`` positions at a time.

    hidden [N, H] (the final hidden states of the scored positions), weight [V, H], targets [N].
    Logits are ``scale * (hidden @ weight.T + bias)``, soft-capped as ``softcap * tanh(logits /
    softcap)`` when given (Gemma 2/3). Each chunk's [chunk, V] logits exist only while that chunk is
    computed: with autograd on, a chunk is checkpointed, so backward recomputes its logits instead of
    keeping them (the memory of one chunk, not of N x V). Values and gradients equal those of the
    whole [N, V] at once up to float summation order. (One chunk in all keeps its logits instead.)

    entropy: "grad" (differentiable), "metric" (computed without a graph), "none".
    Returns float32 [N] log-probs and [N] entropies (None for "none").
    """
    _check_temperature(temperature)

    def chunk(h: Tensor, w: Tensor, b: Tensor | None, t: Tensor) -> tuple[Tensor, Tensor]:
        logits = torch.nn.functional.linear(h, w, b)
        if scale != 1.0:
            logits = logits * scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        lp, ent = logprobs_and_entropy(logits, t, temperature, entropy)
        return lp, ent if ent is not None else lp.new_zeros(())  # checkpoint returns tensors only

    # One chunk is the whole input: keeping its logits for backward costs the memory of one chunk, as
    # recomputing them would, so only several chunks are checkpointed (one less head pass in backward).
    checkpointed = (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
                    and hidden.shape[0] > max(1, chunk_tokens))
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], max(1, chunk_tokens)):
        args = (hidden[start : start + chunk_tokens], weight, bias, targets[start : start + chunk_tokens])
        if checkpointed:
            lp, ent = torch.utils.checkpoint.checkpoint(chunk, *args, use_reentrant=False)
        else:
            lp, ent = chunk(*args)
        logprobs.append(lp)
        entropies.append(ent)
    if not logprobs:  # no scored position
        # Kept connected to the hidden states and the head: under FSDP a rank with nothing to score (an
        # empty micro-batch) must still run backward through every layer, whose hooks gather parameters
        # in step with the other ranks.
        empty = hidden.new_zeros((0,), dtype=torch.float32) + hidden.sum() * 0 + weight.sum() * 0
        return empty, (empty if entropy != "none" else None)
    return torch.cat(logprobs), (torch.cat(entropies) if entropy != "none" else None)
