"""A group's prompt computed once: samples that begin with the same tokens share one copy of them.

The samples of a GRPO group carry one prompt and n responses. Laid out one sample per row, the trainer
runs the prompt n times forward and backward, in the old and reference passes too; with prompts of 100
tokens and answers of 30, most of its work is copies. Here a *unit* (samples with a common prefix) is
one stretch of a row: the prefix once, then each sample's own tokens after it::

    row:       [ p0 p1 p2 p3 | a4 a5 a6 | b4 b5 | c4 c5 c6 c7 ]
    positions:   0  1  2  3    4  5  6    4  5    4  5  6  7
    segment:     0  0  0  0    1  1  1    2  2    3  3  3  3

and attention lets a token see the earlier tokens of its own segment and of the prefix (segment 0), in
its own unit only. Positions continue from the prefix in every segment, so each sample sees exactly
the tokens, at exactly the positions, it would alone. A response's first token is predicted from the
prefix's last position, which all the unit's samples share, so predictions are gathered per sample
rather than read off the next column: a micro-batch's outputs are one flat row of every sample's
response positions in turn (``MicroBatch.hidden_index`` says which hidden state predicts each). Losses,
aggregation and metrics read that row as they read any other (they go by mask and ``seq_index``).

The mask is built for the model's own attention implementation by transformers' mask interface
(``masking_utils``): a boolean mask for SDPA, an additive one for eager attention, a BlockMask for
flex attention (which skips the masked blocks on GPU). Flash attention takes only whole sequences and
cannot express it.

What is shared is what is identical: the longest common prefix of a unit's samples, never past the
shortest prompt (the response positions of a sample are always its own). Multi-turn samples whose
prompts diverge after the first turn share the first turn; samples with nothing in common are laid
out as the packed layout would, one segment each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tether.trainer.batch import MicroBatch, TrainBatch, fill_response_values

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Implementations whose masks transformers builds from a mask function (and that accept a 4-D mask).
MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")


@dataclass(frozen=True)
class Unit:
    """Samples laid out together: ``shared`` leading tokens once, then each member's remaining tokens."""

    members: tuple[int, ...]
    shared: int

    def length(self, batch: TrainBatch) -> int:
        """Tokens the unit occupies in a row."""
        return self.shared + sum(len(batch.tokens[i]) - self.shared for i in self.members)


def common_prefix(batch: TrainBatch, members: list[int] | tuple[int, ...]) -> int:
    """The longest prefix all ``members`` share, within the shortest of their prompts."""
    first = batch.tokens[members[0]]
    limit = min(batch.prompt_lengths[i] for i in members)
    for i in members[1:]:
        other = batch.tokens[i]
        k = 0
        while k < limit and first[k] == other[k]:
            k += 1
        limit = k
    return limit


def _key(batch: TrainBatch, i: int) -> Any:
    # Samples of one data row share its prompt; a batch without ids (SFT) groups identical prompts.
    if batch.sample_ids:
        return batch.sample_ids[i][0]
    return tuple(batch.tokens[i][: batch.prompt_lengths[i]])


def plan_units(batch: TrainBatch, indices: list[int], max_members: int | None = None,
               max_tokens: int | None = None) -> list[Unit]:
    """``indices`` as units: samples of one prompt together (in order of first appearance), split into
    runs of at most ``max_members`` samples and ``max_tokens`` tokens in a row (a sample longer than
    that alone), each sharing its members' common prefix."""
    groups: dict[Any, list[int]] = {}
    for i in indices:
        groups.setdefault(_key(batch, i), []).append(i)
    units: list[Unit] = []
    for members in groups.values():
        shared = common_prefix(batch, members)
        part: list[int] = []
        for i in members:
            grown = shared + sum(len(batch.tokens[j]) - shared for j in part + [i])
            if part and ((max_members and len(part) >= max_members) or (max_tokens and grown > max_tokens)):
                units.append(_unit(batch, part))
                part = []
            part.append(i)
        units.append(_unit(batch, part))
    return units


def _unit(batch: TrainBatch, members: list[int] | tuple[int, ...]) -> Unit:
    return Unit(tuple(members), common_prefix(batch, members) if len(members) > 1 else 0)


def split_to(units: list[Unit], batch: TrainBatch, parts: int) -> list[Unit]:
    """Units split (largest first, in halves) until there are at least ``parts`` of them, where members allow:
    every rank then has work of its own."""
    units = list(units)
    while len(units) < parts:
        big = max(range(len(units)), key=lambda u: (len(units[u].members), -u), default=None)
        if big is None or len(units[big].members) < 2:
            break
        members = units.pop(big).members
        half = len(members) // 2
        for part in (members[:half], members[half:]):
            units.insert(big, _unit(batch, part))
            big += 1
    return units


def shares_anything(units: list[Unit]) -> bool:
    return any(len(u.members) > 1 and u.shared > 0 for u in units)


def collate_shared(batch: TrainBatch, units: list[Unit], pad_id: int) -> MicroBatch:
    """The units of one micro-batch in rows as wide as the longest unit (first-fit, longest first).

    Outputs are one row: each sample's response predictions in turn, in the units' member order."""
    lengths = [u.length(batch) for u in units]
    width = max(lengths)
    row_of, fill = [0] * len(units), list[int]()
    for u in sorted(range(len(units)), key=lambda u: (-lengths[u], u)):
        row = next((r for r, used in enumerate(fill) if used + lengths[u] <= width), None)
        if row is None:
            row = len(fill)
            fill.append(0)
        row_of[u] = row
        fill[row] += lengths[u]
    rows = len(fill)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    # A unit's number in its row (padding: one past the last) and each token's segment (0: the prefix).
    unit_no = torch.zeros((rows, width), dtype=torch.long)
    segment = torch.zeros((rows, width), dtype=torch.long)
    members = [i for u in units for i in u.members]
    total = sum(batch.response_lengths[i] for i in members)
    hidden_rows, hidden_cols = torch.zeros(total, dtype=torch.long), torch.zeros(total, dtype=torch.long)
    targets = torch.zeros((1, total), dtype=torch.long)
    out = tuple(torch.zeros((1, total), dtype=dt) for dt in (torch.float32, torch.float32, torch.long, torch.bool))
    offsets, spans, indices = [0] * rows, list[tuple[int, int]](), list[int]()
    flat = 0
    for u, unit in enumerate(units):
        row, start = row_of[u], offsets[row_of[u]]
        first = batch.tokens[unit.members[0]]
        s = unit.shared
        input_ids[row, start : start + s] = torch.tensor(first[:s], dtype=torch.long)
        positions[row, start : start + s] = torch.arange(s)
        unit_no[row, start : start + lengths[u]] = u
        at = start + s
        for k, i in enumerate(unit.members, start=1):
            toks, p, r = batch.tokens[i], batch.prompt_lengths[i], batch.response_lengths[i]
            own = len(toks) - s
            input_ids[row, at : at + own] = torch.tensor(toks[s:], dtype=torch.long)
            positions[row, at : at + own] = torch.arange(s, len(toks))
            segment[row, at : at + own] = k
            # Response token t (absolute index p + j) is predicted by the hidden state of token t - 1,
            # which is the prefix's last one when t - 1 < s (only the first token, when p == s).
            before = torch.arange(p - 1, p - 1 + r)
            hidden_rows[flat : flat + r] = row
            hidden_cols[flat : flat + r] = torch.where(before < s, start + before, at + before - s)
            targets[0, flat : flat + r] = torch.tensor(toks[p:], dtype=torch.long)
            fill_response_values(out, batch, i, len(indices), 0, flat)
            spans.append((0, flat))
            indices.append(i)
            flat += r
            at += own
        offsets[row] = at
    for row, used in enumerate(offsets):
        unit_no[row, used:] = len(units)  # padding: a unit of its own, attending causally to itself
        positions[row, used:] = torch.arange(width - used)
    return MicroBatch(input_ids, None, targets, out[0], out[1], indices, spans, out[2], positions, out[3],
                      hidden_index=(hidden_rows, hidden_cols), attention_layout=(unit_no, segment))


def unit_token_limit(model: PreTrainedModel) -> int | None:
    """The widest row a unit may take. A dense mask (SDPA, eager on CPU) costs every pair of a row's
    tokens, about 4 * hidden FLOPs a pair against 12 * hidden^2 a token for the rest of a layer: past a
    few times the hidden size, a longer row costs more in attention than sharing saves. Flex attention
    skips the masked blocks: no limit."""
    if model.config._attn_implementation == "flex_attention":
        return None
    return 3 * int(model.config.hidden_size)


def attention_mask(model: PreTrainedModel, mb: MicroBatch, device: torch.device | str | None = None) -> Any:
    """The micro-batch's 4-D mask in the form the model's attention implementation takes, on ``device``
    (default: the micro-batch's)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert mb.attention_layout is not None
    impl = model.config._attn_implementation
    if impl not in MASKED_ATTENTION:
        raise ValueError(f"train.share_prompts lays samples out with a custom attention mask, which "
                         f"{type(model).__name__}'s attention {impl!r} cannot take (it needs one of "
                         f"{', '.join(MASKED_ATTENTION)}): set train.share_prompts=false")
    device = device if device is not None else mb.input_ids.device
    unit_no, segment = (t.to(device) for t in mb.attention_layout)

    def allowed(b, h, q, kv):
        # Causal, within one unit, and only the prefix's tokens or the query's own segment's.
        return (kv <= q) & (unit_no[b, kv] == unit_no[b, q]) & ((segment[b, kv] == 0) | (segment[b, kv] == segment[b, q]))

    rows, width = mb.input_ids.shape
    return ALL_MASK_ATTENTION_FUNCTIONS[impl](batch_size=rows, q_length=width, kv_length=width, mask_function=allowed,
                                              device=device, dtype=torch.float32, allow_is_causal_skip=False)
