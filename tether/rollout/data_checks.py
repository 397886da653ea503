"""Every prompt row checked against the model and the run before anything starts.

The rollout manager loads its data with the same checks (so data.skip_bad_rows behaves the same
in both places); the launching process runs them first, in seconds, so that an empty prompt, a
prompt the model's positions cannot hold with its response, or a label the reward cannot score is
reported with its file and line before Ray starts, not when the row is drawn rollouts later.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tether.config import TetherConfig
from tether.errors import ConfigError
from tether.rewards.builtin import BUILTIN_REWARDS
from tether.rollout.data_source import DatasetError, LoadedRows, RowChecks, load_prompt_rows
from tether.rollout.prompt_format import PromptFormat

# The built-in rewards compare str(label) with the response: text and numbers only.
SCORABLE_LABELS = (str, int, float)


def model_positions(model_path: str) -> int | None:
    """max_position_embeddings from the model's config.json (None when it does not say)."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"model.path: cannot read {path}: {err}") from None
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


# The built-in rewards that compare the response with the row's label (reasoning_gym's read the metadata).
LABEL_REWARDS = ("math", "exact_match", "f1")


def row_checks(cfg: TetherConfig, reward: str, max_response_len: int, positions: int | None) -> RowChecks:
    builtin = reward in BUILTIN_REWARDS
    # A label key the config names, or a reward that compares the label: a row without it would be
    # scored against None on every sample, without a word.
    required = "label_key" in cfg.data.model_fields_set or reward in LABEL_REWARDS
    return RowChecks(max_positions=positions, max_response_len=max_response_len,
                     label_types=SCORABLE_LABELS if builtin else None, label_required=required, reward=reward,
                     skip_bad_rows=cfg.data.skip_bad_rows)


def load_keys(cfg: TetherConfig) -> dict[str, Any]:
    d = cfg.data
    return dict(prompt_key=d.prompt_key, label_key=d.label_key, metadata_key=d.metadata_key, split=d.split,
                subset=d.subset, fmt=PromptFormat.from_config(d), max_prompt_len=d.max_prompt_len)


def not_generated(field: str) -> ConfigError:
    """A reasoning_gym: section reached a loader without files: only check_inputs writes them."""
    return ConfigError(f"{field}.reasoning_gym: its problems are not written yet; tether.run.preflight.check_inputs"
                       "(cfg, command) writes them and points the config at the files (the CLI runs it first)")


def load_train_rows(cfg: TetherConfig, tokenizer: Any, positions: int | None) -> LoadedRows:
    if cfg.data.path is None and cfg.data.reasoning_gym is not None:
        raise not_generated("data")
    assert cfg.data.path is not None  # the callers load train rows only for a data section with a source
    r = cfg.rollout
    return load_prompt_rows(cfg.data.path, tokenizer, **load_keys(cfg),
                            checks=row_checks(cfg, r.reward, r.max_response_len, positions))


def load_eval_rows(cfg: TetherConfig, tokenizer: Any, positions: int | None) -> list[LoadedRows]:
    paths: list[str] = []
    for i, e in enumerate(cfg.eval.datasets):
        if e.path is None:
            raise not_generated(f"eval.datasets[{i}]")
        paths.append(e.path)
    return [load_prompt_rows(path, tokenizer, **{**load_keys(cfg), "split": e.split},
                             checks=row_checks(cfg, e.reward or cfg.rollout.reward, e.max_response_len, positions))
            for path, e in zip(paths, cfg.eval.datasets)]


def check_prompt_data(cfg: TetherConfig) -> list[str]:
    """Load every prompt and eval row as the run will; raises DatasetError naming the file and line of
    the first bad row (with data.skip_bad_rows: returns what would be skipped, one line per row)."""
    from tether.models.hf import load_tokenizer

    positions = model_positions(cfg.model.path)
    tokenizer = load_tokenizer(cfg.model.path)
    loaded = load_eval_rows(cfg, tokenizer, positions)
    if cfg.data.path is not None or cfg.data.reasoning_gym is not None:
        loaded.append(load_train_rows(cfg, tokenizer, positions))
    return [line for rows in loaded for line in rows.skipped]


__all__ = ["DatasetError", "check_prompt_data", "load_eval_rows", "load_train_rows", "model_positions", "row_checks"]
