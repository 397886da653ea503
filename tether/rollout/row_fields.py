"""A row's fields by key: a top-level key, or a dotted path into nested objects (verl's rows keep the
answer at ``reward_model.ground_truth``)."""

from __future__ import annotations

from typing import Any

MISSING = object()


def field_value(obj: dict, key: str) -> Any:
    """``obj[key]``, or with a dotted key the nested field (``reward_model.ground_truth``, verl's rows);
    MISSING when the row has neither."""
    if key in obj:
        return obj[key]
    value: Any = obj
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value
