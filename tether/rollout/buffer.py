"""Partial rollout (``rollout.partial_rollout``): unfinished groups carried into the next rollout.

When a rollout has its groups, the driver aborts the ones still generating. With partial rollout
they keep what they generated and wait here, together with groups that finished too late to be kept;
the next rollout starts them first, continuing each aborted response from where it stopped with the
tokens it has left. Each generation call records its weight version and length (Sample.weight_versions,
span_lengths), so a response can tell which of its tokens came from older weights
(``rollout.mask_offpolicy_partial`` leaves those out of the loss). The buffer is saved with every
checkpoint: a resumed run continues the same groups.
"""

from __future__ import annotations

from tether.sample import Sample, sample_from_dict

BUFFER_STATE = "rollout_buffer.json"  # an older checkpoint's file; now the "buffer" of data_source.json


class PartialBuffer:
    def __init__(self) -> None:
        self.groups: list[list[Sample]] = []

    def __len__(self) -> int:
        return len(self.groups)

    def take(self) -> list[list[Sample]]:
        groups, self.groups = self.groups, []
        return groups

    def put(self, groups: list[list[Sample]]) -> None:
        self.groups.extend(groups)

    def state_dict(self) -> dict:
        return {"groups": [[s.to_dict() for s in group] for group in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.groups = [[sample_from_dict(row) for row in group] for group in state["groups"]]


def mask_stale_spans(sample: Sample) -> int:
    """Set the loss mask to 0 over the spans of a continued response that older weights generated than
    the ones that finished it (its last span); returns how many tokens that masked. As in slime, a
    response generated in one call is left alone, whichever weights generated it."""
    if len(sample.span_lengths) < 2:
        return 0
    newest = sample.weight_versions[-1]
    mask = sample.response_loss_mask()
    start, masked = 0, 0
    for span_version, length in zip(sample.weight_versions, sample.span_lengths):
        if span_version < newest:
            masked += sum(mask[start:start + length])
            mask[start:start + length] = [0] * length
        start += length
    if masked:
        sample.loss_mask = mask
    return masked
