"""The Sample: one prompt plus one generated response, the unit of a rollout."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One generation for one prompt, filled in stage by stage.

    The data source creates it with the prompt fields; the rollout engine fills the
    response fields; the reward function sets `reward`.

    Attributes:
        prompt_index: index of the prompt in the loaded row list (0-based, after
            length filtering), so samples can be traced back to their data row.
        sample_index: position within the prompt's group, 0..n-1.
        prompt: raw prompt as in the data (a string or a list of chat messages).
        label: reference answer from the data (any JSON value, or None).
        metadata: free-form per-row data passed through to reward functions.
        prompt_ids: token ids of the (possibly chat-formatted) prompt.
        response_ids: generated token ids.
        response_logprobs: engine log-probabilities of `response_ids`.
        response_text: decoded response.
        finish_reason: "stop" | "length" | "abort".
        reward: scalar reward, None until computed.
    """

    prompt_index: int
    sample_index: int
    prompt: str | list[dict]
    label: Any
    metadata: dict
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_text: str = ""
    finish_reason: str = ""
    reward: float | None = None

    @property
    def response_length(self) -> int:
        """Number of generated tokens."""
        return len(self.response_ids)

    def to_dict(self) -> dict:
        """Return a JSON-serialisable dict of all fields (for dumping rollouts).

        Non-finite floats become None because JSON has no NaN/Infinity. Label and
        metadata come from JSON data, so they are deep-copied rather than converted.
        """
        return {
            "prompt_index": int(self.prompt_index),
            "sample_index": int(self.sample_index),
            "prompt": copy.deepcopy(self.prompt),
            "label": copy.deepcopy(self.label),
            "metadata": copy.deepcopy(self.metadata),
            "prompt_ids": [int(t) for t in self.prompt_ids],
            "response_ids": [int(t) for t in self.response_ids],
            "response_logprobs": [_json_float(x) for x in self.response_logprobs],
            "response_text": self.response_text,
            "finish_reason": self.finish_reason,
            "response_length": self.response_length,
            "reward": None if self.reward is None else _json_float(self.reward),
        }


def _json_float(value: float) -> float | None:
    """Convert to a plain float, mapping NaN/inf to None (invalid in strict JSON)."""
    value = float(value)
    return value if math.isfinite(value) else None
