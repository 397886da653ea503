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
    """Tensors for one forward pass. Position j of the [B, L-1] tensors scores token j+1.

    Padded: one sample per row, right-padded, with an attention mask. Packed: samples concatenated
    in one row with no padding; ``position_ids`` restart at 0 for each sample, which is how the
    model knows not to attend across samples (attention_mask is then None).
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor | None  # [B, L]; None when packed
    targets: torch.Tensor  # [B, L-1] = input_ids[:, 1:]
    response_mask: torch.Tensor  # [B, L-1] float, 1 where the target is a response token
    rollout_logprobs: torch.Tensor  # [B, L-1] engine log-probs at response positions, 0 elsewhere
    indices: list[int]  # samples of the source batch
    spans: list[tuple[int, int]] = field(default_factory=list)
    """(row, column) where each sample's first response prediction sits, in ``indices`` order."""
    seq_index: torch.Tensor | None = None  # [B, L-1] which of ``indices`` each position belongs to
    position_ids: torch.Tensor | None = None  # [B, L] when packed

    @property
    def num_tokens(self) -> float:
        return float(self.response_mask.sum())


def _fill_response(mb_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch: TrainBatch, i: int, local: int,
                   row: int, start: int) -> None:
    response_mask, rollout_lp, seq_index = mb_rows
    r = batch.response_lengths[i]
    response_mask[row, start : start + r] = 1.0
    seq_index[row, start : start + r] = local
    if batch.rollout_logprobs is not None and r:
        rollout_lp[row, start : start + r] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)


def collate(batch: TrainBatch, indices: list[int], pad_id: int) -> MicroBatch:
    """Pad the chosen samples on the right into one MicroBatch."""
    length = max(len(batch.tokens[i]) for i in indices)
    n = len(indices)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    rows = (torch.zeros((n, length - 1)), torch.zeros((n, length - 1)), torch.zeros((n, length - 1), dtype=torch.long))
    spans = []
    for row, i in enumerate(indices):
        toks, p = batch.tokens[i], batch.prompt_lengths[i]
        input_ids[row, : len(toks)] = torch.tensor(toks)
        attention[row, : len(toks)] = 1
        # Response token k (absolute position p + k) is predicted by the logits at position p + k - 1.
        _fill_response(rows, batch, i, row, row, p - 1)
        spans.append((row, p - 1))
    return MicroBatch(input_ids, attention, input_ids[:, 1:], rows[0], rows[1], list(indices), spans, rows[2])


def collate_packed(batch: TrainBatch, indices: list[int], pad_id: int) -> MicroBatch:
    """Pack the chosen samples into rows as wide as the longest of them, without per-sample padding.

    Samples share a row end to end (first-fit, longest first); positions restart at 0 for each
    sample, which keeps attention within samples (attention_mask is then None). Rows are as wide as
    the longest sample, not the whole micro-batch, because on CPU attention over a row costs its
    width squared. An empty ``indices`` gives a one-row no-op: a rank with fewer samples than
    micro-batches still runs its share of the collectives.
    """
    if not indices:
        ids = torch.full((1, 2), pad_id, dtype=torch.long)
        zeros = torch.zeros((1, 1))
        return MicroBatch(ids, None, ids[:, 1:], zeros, zeros.clone(), [], [], torch.zeros((1, 1), dtype=torch.long),
                          torch.arange(2)[None])
    width = max(len(batch.tokens[i]) for i in indices)
    row_of: dict[int, int] = {}
    fill: list[int] = []
    for i in sorted(indices, key=lambda i: (-len(batch.tokens[i]), i)):
        row = next((r for r, used in enumerate(fill) if used + len(batch.tokens[i]) <= width), None)
        if row is None:
            row, _ = len(fill), fill.append(0)
        row_of[i] = row
        fill[row] += len(batch.tokens[i])
    input_ids = torch.full((len(fill), width), pad_id, dtype=torch.long)
    # Padding at a row's end restarts its positions too: it is a separate (ignored) sequence.
    positions = torch.zeros((len(fill), width), dtype=torch.long)
    rows = tuple(torch.zeros((len(fill), width - 1), dtype=dt) for dt in (torch.float32, torch.float32, torch.long))
    offsets = [0] * len(fill)
    spans = []
    for local, i in enumerate(indices):
        row, offset, toks = row_of[i], offsets[row_of[i]], batch.tokens[i]
        input_ids[row, offset : offset + len(toks)] = torch.tensor(toks)
        positions[row, offset : offset + len(toks)] = torch.arange(len(toks))
        # The last token of a sample "predicts" the next sample's first: masked out, never a response.
        _fill_response(rows, batch, i, local, row, offset + batch.prompt_lengths[i] - 1)
        spans.append((row, offset + batch.prompt_lengths[i] - 1))
        offsets[row] += len(toks)
    for row, used in enumerate(offsets):
        positions[row, used:] = torch.arange(width - used)
    return MicroBatch(input_ids, None, input_ids[:, 1:], rows[0], rows[1], list(indices), spans, rows[2], positions)


def split_micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
