"""Dynamic-sampling filters: which generated groups a rollout keeps.

A filter is called with the scored samples of one group and returns ``True`` (keep), ``False``
(drop), or ``(keep, reason)``; the reason names the drop in the metrics
(``rollout/groups_dropped/<reason>``). ``rollout.dynamic_filter`` names a built-in below, or a
``module:fn`` / ``file.py:fn`` of the user's (slime's ``--dynamic-sampling-filter-path`` functions
take the same group of samples).
"""

from __future__ import annotations

import statistics
from typing import Callable

from tether.importing import load_function
from tether.sample import Sample

Filter = Callable[[list[Sample]], tuple[bool, str]]


def nonzero_reward_std(samples: list[Sample]) -> tuple[bool, str]:
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero group-relative advantage
    everywhere, so it would cost a step and teach nothing."""
    rewards = [s.scored_reward() for s in samples]
    if len(rewards) > 1 and statistics.pstdev(rewards) > 0:
        return True, ""
    return False, "all_correct" if rewards and min(rewards) > 0 else "zero_std"


BUILTIN_FILTERS: dict[str, Callable[[list[Sample]], object]] = {"nonzero_reward_std": nonzero_reward_std}


class FilterError(ValueError):
    pass


def keep_all(samples: list[Sample]) -> tuple[bool, str]:
    return True, ""


def load_filter(spec: str | None, field: str = "rollout.dynamic_filter", args: dict | None = None) -> Filter:
    """The filter ``spec`` names (``keep_all`` for None), wrapped to always return (keep, reason)."""
    if spec is None:
        return keep_all
    if ":" in spec:
        try:
            fn = load_function(spec, "dynamic filter", FilterError, args)
        except FilterError as err:
            raise FilterError(f"{field}: {err}") from None
    elif spec in BUILTIN_FILTERS:
        fn = BUILTIN_FILTERS[spec]
    else:
        raise FilterError(f"{field} '{spec}': unknown built-in filter; built-ins are {sorted(BUILTIN_FILTERS)}, "
                          "or give 'module:function' / 'file.py:function'")

    def checked(samples: list[Sample]) -> tuple[bool, str]:
        group = f"group of prompt_index={samples[0].prompt_index}, rollout {samples[0].rollout_id}"
        try:
            out = fn(samples)
        except Exception as err:
            raise FilterError(f"{field} '{spec}' raised {type(err).__name__}: {err} ({group})") from err
        keep, reason = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
        if not isinstance(keep, bool) or not (reason is None or isinstance(reason, str)):
            raise FilterError(f"{field} '{spec}' returned {out!r:.200} for the {group}; expected a bool or "
                              "(bool, reason string)")
        return keep, reason or ("" if keep else "filtered")

    return checked
