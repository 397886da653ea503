"""`model.lora`: low-rank adapters on the policy's linear layers (tether/models/lora.py). Imports
without torch, like every config section."""

from __future__ import annotations

from pydantic import Field, field_validator

from tether.config.base import Section

ALL_LINEAR = "all-linear"


class LoRAConfig(Section):
    """Train low-rank adapters instead of the whole model: each targeted linear layer W x becomes
    W x + (alpha / rank) B A x, with W frozen, A (rank x in) random and B (out x rank) zero at the start,
    so the first policy is the base model. Only A and B train, sit in the optimizer and go into
    checkpoints; the reference policy for KL is the base with the adapters off (no second copy); a
    weight push sends only the merged weights of the targeted layers."""

    rank: int = Field(16, ge=1)
    """The adapters' rank r."""
    alpha: float = Field(32.0, gt=0)
    """Scale numerator: the update is (alpha / rank) B A (PEFT's lora_alpha)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (PEFT's lora_dropout)."""
    target_modules: list[str] | str = ALL_LINEAR
    """Which linear layers get adapters, as in PEFT: a list of names, each matching a module whose
    dotted name is it or ends with "." + it (["q_proj", "v_proj"]); one string is a regular expression
    the whole dotted name must match; "all-linear" is every linear layer but the output head."""

    @field_validator("target_modules")
    @classmethod
    def _not_empty(cls, value: list[str] | str) -> list[str] | str:
        if not value:
            raise ValueError("names no module: give a list of names, a regular expression or 'all-linear'")
        return value
