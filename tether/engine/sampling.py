"""Sampling settings of one request (SGLang's sampling_params, validated): temperature, top-k, top-p,
min-p, greedy, stop tokens and strings, a seed. The engine samples with them in row_sampling.py.

The reported log-prob is that of the token under softmax(logits / temperature) before top-k/top-p/min-p
filtering: the distribution the trainer recomputes (it divides by the same temperature), so that
on-policy log-probs of engine and trainer agree. Greedy rows (temperature 0) report it at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field


_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy (its log-probs are reported at temperature 1)."""
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Token ids that end the response (kept in the output), on top of the engine's eos ids."""
    min_p: float = 0.0
    """Keep tokens whose probability (after temperature) is >= min_p * the largest probability; 0 = off."""
    ignore_eos: bool = False
    """The engine's eos ids do not end the response (stop_token_ids and stop strings still do)."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Stop strings: the response ends once its decoded text contains one (a str or list is made a tuple)."""
    seed: int | None = None
    """Per-request seed: the request's noise stream (row_sampling.py), whatever its batch-mates."""

    def __post_init__(self) -> None:
        # Normalise the sequence fields to tuples so the params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of token ids >= 0, got {self.stop_token_ids!r}")
        if isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64 - 1], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
