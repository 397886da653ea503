"""Resuming a run: which config changes a checkpoint accepts, and trimming logs to the checkpoint.

A resumed run must continue the run that was saved. Fields that only change how the run is watched
or how long it goes on may change freely; anything else (model, data, batch shapes, algorithm,
seed) is refused with a list of what differs, unless the user names the field in
``checkpoint.allow_config_change`` to say the change is intended.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tether.config import ConfigError

# Dotted prefixes that never break a resume.
HARMLESS = (
    "output_dir",
    "cluster.",  # layout, timeouts, threads: DCP re-shards across trainer counts
    "tracking.",
    "eval.",
    "checkpoint.",
    "rollout.num_rollout",  # extend (or shorten) a run
    "rollout.num_epoch",
    "engine.max_generate_batch",
    "engine.max_batch_tokens",
    "engine.host",
    "engine.onednn_linear",  # engine kernels and caches: same math
    "engine.prefix_cache_tokens",
    "engine.urls",  # external servers may move; they serve the checkpoint's weights once connected
    "train.micro_batch_size",  # the normaliser is global: same gradient, other memory use
    "train.max_tokens_per_micro_batch",
)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def changed_fields(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    old, new = flatten(saved), flatten(current)
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def _allowed(field: str, extra: list[str]) -> bool:
    for prefix in (*HARMLESS, *extra):
        if prefix.endswith("."):
            if field.startswith(prefix):
                return True
        elif field == prefix or field.startswith(prefix + "."):
            return True
    return False


def check_resume_config(saved: dict, current: dict, checkpoint: str) -> None:
    """Raise ConfigError listing every refused change between the saved and the current config."""
    extra = list(current.get("checkpoint", {}).get("allow_config_change", []))
    refused = {k: v for k, v in changed_fields(saved, current).items() if not _allowed(k, extra)}
    if refused:
        lines = [f"  {k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in refused.items()]
        raise ConfigError(
            f"cannot resume from {checkpoint}: the config changed in ways that would break the run:\n"
            + "\n".join(lines)
            + "\nrestore these values, or list the fields in checkpoint.allow_config_change if the change is intended"
        )


def trim_jsonl(path: Path, keep: Any) -> int:
    """Rewrite a JSONL file keeping rows for which ``keep(row)`` is true; returns rows dropped.

    After a crash, rows written for rollouts later than the checkpoint describe work that is redone
    on resume; dropping them keeps each file a record of one uninterrupted run.
    """
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the crash
        if keep(row):
            kept.append(json.dumps(row))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return len(lines) - len(kept)
