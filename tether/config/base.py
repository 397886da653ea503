"""The base of every config section (config.py and the components' own sections, e.g. engine/config.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # extra="forbid": a typo in a recipe is an error, never an ignored key.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
