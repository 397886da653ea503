"""The train batch: what rollout hands the trainer (through the object store), and its tensor form.

Tokens in, tokens out: the batch carries the exact token ids the engine produced and the engine's
log-probs of them; the trainer never re-tokenizes text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainBatch:
    """Samples of one rollout (or one SFT step), grouped: samples of one prompt are adjacent."""

    tokens: list[list[int]]
    """prompt + response token ids per sample."""
    prompt_lengths: list[int]
    response_lengths: list[int]
    group_size: int = 1
    rewards: list[float] | None = None
    """None for supervised batches."""
    rollout_logprobs: list[list[float]] | None = None
    """Engine log-probs of each response token (len == response_length)."""
    temperature: float = 1.0
    """Sampling temperature of the rollout: the trainer divides logits by it."""
    sample_ids: list[tuple[int, int]] = field(default_factory=list)
    """(prompt index, sample index) per sample: which data was trained on."""

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: list[int]) -> TrainBatch:
        def pick(values):
            return None if values is None else [values[i] for i in indices]

        return TrainBatch(
            tokens=pick(self.tokens),
            prompt_lengths=pick(self.prompt_lengths),
            response_lengths=pick(self.response_lengths),
            group_size=self.group_size,
            rewards=pick(self.rewards),
            rollout_logprobs=pick(self.rollout_logprobs),
            temperature=self.temperature,
            sample_ids=pick(self.sample_ids) if self.sample_ids else [],
        )

    def validate(self) -> None:
        n = len(self.tokens)
        for name in ("prompt_lengths", "response_lengths", "rewards", "rollout_logprobs", "sample_ids"):
            values = getattr(self, name)
            if values is None or (name == "sample_ids" and not values):
                continue  # optional fields
            if len(values) != n:
                raise ValueError(f"TrainBatch.{name} has {len(values)} entries for {n} samples")
        for i, (toks, p, r) in enumerate(zip(self.tokens, self.prompt_lengths, self.response_lengths)):
            if p < 1 or p + r != len(toks):
                raise ValueError(f"TrainBatch sample {i}: prompt {p} + response {r} != {len(toks)} tokens")
            if self.rollout_logprobs is not None and len(self.rollout_logprobs[i]) != r:
                raise ValueError(f"TrainBatch sample {i}: {len(self.rollout_logprobs[i])} log-probs for {r} tokens")


@dataclass
class MicroBatch:
    """Right-padded tensors for one forward pass. Position j of the [B, L-1] tensors scores token j+1."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] = input_ids[:, 1:]
    response_mask: torch.Tensor  # [B, L-1] float, 1 where the target is a response token
    rollout_logprobs: torch.Tensor  # [B, L-1] engine log-probs at response positions, 0 elsewhere
    indices: list[int]  # rows of the source batch

    @property
    def num_tokens(self) -> float:
        return float(self.response_mask.sum())


def collate(batch: TrainBatch, indices: list[int], pad_id: int) -> MicroBatch:
    """Pad the chosen samples on the right into one MicroBatch."""
    length = max(len(batch.tokens[i]) for i in indices)
    n = len(indices)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    response_mask = torch.zeros((n, length - 1), dtype=torch.float32)
    rollout_lp = torch.zeros((n, length - 1), dtype=torch.float32)
    for row, i in enumerate(indices):
        toks, p, r = batch.tokens[i], batch.prompt_lengths[i], batch.response_lengths[i]
        input_ids[row, : len(toks)] = torch.tensor(toks)
        attention[row, : len(toks)] = 1
        # Response token k (absolute position p + k) is predicted by the logits at position p + k - 1.
        response_mask[row, p - 1 : p - 1 + r] = 1.0
        if batch.rollout_logprobs is not None and r:
            rollout_lp[row, p - 1 : p - 1 + r] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
    return MicroBatch(input_ids, attention, input_ids[:, 1:], response_mask, rollout_lp, list(indices))


def split_micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
