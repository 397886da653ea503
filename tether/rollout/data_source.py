"""Prompt dataset loading (JSONL) and the epoch-based prompt iterator.

Data format: one JSON object per line, blank lines skipped. Each object has a
prompt (a string, or a list of {"role", "content"} chat messages), an optional
label (reference answer, any JSON value) and an optional metadata dict. The key
names are configurable.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from tether.rollout.hf_rows import is_hf_source, is_hub, read_hf_rows
from tether.rollout.row_fields import MISSING, field_value
from tether.rollout.prompt_format import (DatasetError, PromptFormat, encode_text, fill_template, get_prompt,
                                          render_prompt)
from tether.sample import Sample

PLAIN = PromptFormat()  # the prompt field as it is

__all__ = ["DataSource", "DatasetError", "LoadedRows", "PromptRow", "RowChecks", "load_prompt_rows", "read_jsonl",
           "read_rows"]


@dataclass
class PromptRow:
    """One prompt loaded from the dataset.

    Attributes:
        index: position in the loaded row list (after length filtering).
        line: 1-based line number in the source file, for error messages.
        prompt: raw prompt (string or chat messages), as in the file.
        label: reference answer, or None when the row has no label.
        metadata: per-row metadata dict ({} when absent).
        prompt_ids: token ids of the prompt as fed to the engine.
        text: the rendered prompt that was encoded (template, chat template, response prefix).
    """

    index: int
    line: int
    prompt: str | list[dict]
    label: Any
    metadata: dict
    prompt_ids: list[int]
    text: str = ""


@dataclass(frozen=True)
class RowChecks:
    """What a row must satisfy beyond its shape, known from the model and the run's config."""

    max_positions: int | None = None
    """The model's positions: prompt + rollout.max_response_len must fit (None: not checked)."""
    max_response_len: int = 0
    label_types: tuple[type, ...] | None = None
    """Label types the reward can score (None: any; a user's reward decides)."""
    label_required: bool = False
    """A row without the label key is bad (the key was named in the config, or the reward compares the
    label); else a missing label is None."""
    reward: str = ""
    """The reward's name, for messages."""
    skip_bad_rows: bool = False
    """Skip (and count) a row that fails instead of stopping (data.skip_bad_rows)."""


NO_CHECKS = RowChecks()


class LoadedRows(NamedTuple):
    rows: list[PromptRow]
    filtered: int
    """Rows dropped for data.max_prompt_len."""
    skipped: list[str]
    """What was wrong with each bad row skipped (data.skip_bad_rows), file and line first."""


def load_prompt_rows(
    path: str | Path,
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str = "metadata",
    split: str | None = None,
    subset: str | None = None,
    fmt: PromptFormat = PLAIN,
    max_prompt_len: int | None = None,
    checks: RowChecks = NO_CHECKS,
) -> LoadedRows:
    """Load and tokenize a prompt file (JSONL, or Parquet by its .parquet suffix).

    Each prompt is formatted by `fmt` (tether/rollout/prompt_format.py: template, chat template,
    response prefix) and encoded with `add_special_tokens=False`. A chat-message prompt requires
    `fmt.apply_chat_template`. Rows longer than `max_prompt_len` tokens are dropped and counted;
    rows that are malformed or fail `checks` raise, or with `checks.skip_bad_rows` are skipped.

    Raises:
        DatasetError: missing file, invalid JSON, missing/ill-typed fields, an empty prompt, a prompt
            the model's positions cannot hold with the response, a label the reward cannot score, an
            empty file, or every row filtered out. Messages name the file, the line (JSONL) or row
            (Parquet), and the field.
    """
    if not is_hub(path) and not Path(path).exists():
        raise DatasetError(f"{path}: prompt dataset file not found")
    if fmt.apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise DatasetError(
            f"{path}: apply_chat_template is set but the tokenizer has no chat_template"
        )
    rows: list[PromptRow] = []
    skipped: list[str] = []
    num_filtered = num_read = 0

    def bad(err: DatasetError) -> None:
        if not checks.skip_bad_rows:
            raise err
        skipped.append(str(err))

    def bad_line(err: DatasetError) -> None:  # a line that is not even a JSON object
        nonlocal num_read
        num_read += 1
        bad(err)

    for line_no, where, obj in read_rows(path, bad_line, split, subset):
        num_read += 1
        try:
            prompt = get_prompt(obj, where, prompt_key, fmt.apply_chat_template)
            metadata = _get_metadata(obj, where, metadata_key, (prompt_key, label_key))
            text = render_prompt(tokenizer, fill_template(fmt, prompt, obj, where, prompt_key), fmt)
            prompt_ids = encode_text(tokenizer, text)
            if max_prompt_len is not None and len(prompt_ids) > max_prompt_len:
                num_filtered += 1
                continue
            label = field_value(obj, label_key)
            if label is MISSING and checks.label_required:
                raise DatasetError(f"{where}: no field '{label_key}' (data.label_key) for reward {checks.reward}; "
                                   f"keys present: {sorted(obj)}")
            label = None if label is MISSING else label
            _check_row(where, prompt_ids, label, label_key, checks)
        except DatasetError as err:
            bad(err)
            continue
        rows.append(PromptRow(index=len(rows), line=line_no, prompt=prompt, label=label,
                              metadata=metadata, prompt_ids=prompt_ids, text=text))
    if num_read == 0:
        raise DatasetError(f"{path}: prompt dataset contains no rows")
    if not rows:
        why = f"longer than max_prompt_len={max_prompt_len} tokens" if num_filtered else "bad"
        raise DatasetError(f"{path}: all {num_read} rows are {why}" + (f"; first: {skipped[0]}" if skipped else ""))
    return LoadedRows(rows, num_filtered, skipped)


def _check_row(where: str, prompt_ids: list[int], label: Any, label_key: str, checks: RowChecks) -> None:
    if not prompt_ids:
        raise DatasetError(f"{where}: the prompt is empty (after the template): there is nothing to answer")
    need = len(prompt_ids) + checks.max_response_len
    if checks.max_positions is not None and need > checks.max_positions:
        raise DatasetError(f"{where}: the prompt has {len(prompt_ids)} tokens; with rollout.max_response_len="
                           f"{checks.max_response_len} it needs {need} positions, the model has {checks.max_positions} "
                           "(set data.max_prompt_len to drop such rows)")
    if label is not None and checks.label_types is not None and not isinstance(label, checks.label_types):
        kinds = " or ".join(t.__name__ for t in checks.label_types)
        raise DatasetError(f"{where}: field '{label_key}' is a {type(label).__name__}; reward {checks.reward} "
                           f"scores a {kinds} label (it would score this row 0 every time)")


def read_rows(path: Path | str, on_error: Callable[[DatasetError], None] | None = None, split: str | None = None,
              subset: str | None = None) -> Iterator[tuple[int, str, dict]]:
    """Yield (1-based line or row number, where, object) for each row; ``where`` names the file and
    the line (JSONL) or row (Parquet, Arrow and Hugging Face datasets: columns as keys) for error
    messages. A line that is not a JSON object raises, or with ``on_error`` is handed to it and
    skipped. ``split`` and ``subset``: of a Hub dataset (tether/rollout/hf_rows.py)."""
    if is_hub(path):
        yield from read_hf_rows(path, split, subset)
        return
    path = Path(path)
    if is_hf_source(path):
        yield from read_hf_rows(path)
        return
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
        return
    for line_no, obj in read_jsonl(path, on_error):
        yield line_no, f"{path}:{line_no}", obj


def _read_parquet(path: Path) -> Iterator[tuple[int, str, dict]]:
    import pyarrow.parquet as pq  # only Parquet data needs it

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a file it cannot read
        raise DatasetError(f"{path}: not a readable Parquet file ({exc})") from exc
    for n, obj in enumerate(table.to_pylist(), start=1):
        yield n, f"{path} row {n}", obj


def read_jsonl(path: Path, on_error: Callable[[DatasetError], None] | None = None) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line number, object) for each non-blank line (see read_rows for ``on_error``)."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            obj, problem = _parse_line(raw)
            if obj is not None:
                yield line_no, obj
            elif problem is None:
                continue  # blank
            elif on_error is None:
                raise DatasetError(f"{path}:{line_no}: {problem}")
            else:
                on_error(DatasetError(f"{path}:{line_no}: {problem}"))


def _parse_line(raw: bytes) -> tuple[dict | None, str | None]:
    """(object, None), (None, what is wrong with the line), or (None, None) for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    if not line.strip():
        return None, None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg} (column {exc.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    return obj, None


def _get_metadata(obj: dict, where: str, metadata_key: str, taken: tuple[str, ...] = ()) -> dict:
    """The metadata dict of one row: its ``metadata_key`` field; a row without one (a TRL, verl or SkyRL
    dataset's) gives its other top-level fields instead (all but the prompt's and the label's, ``taken``),
    as those libraries hand them to rewards and environments."""
    if metadata_key not in obj:
        tops = {key.split(".", 1)[0] for key in taken}
        return {k: v for k, v in obj.items() if k not in tops}
    metadata = obj.get(metadata_key)
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise DatasetError(f"{where}: field '{metadata_key}' must be a JSON object, got {type(metadata).__name__}")
    return metadata


class DataSource:
    """Epoch-based iterator handing out prompts for each rollout step.

    Each epoch visits the rows in an order that depends only on (seed, epoch): a
    permutation from `np.random.default_rng([seed, epoch])` when shuffling, the file
    order otherwise. The position is thus fully described by (epoch, offset), which
    is all a checkpoint needs to store.

    Each epoch yields `num_rollout_per_epoch = len(rows) // prompts_per_rollout`
    rollouts; the last `len(rows) % prompts_per_rollout` rows of each epoch's order
    are skipped so that epoch boundaries fall on rollout boundaries (with shuffling
    a different remainder is skipped each epoch).
    """

    def __init__(
        self,
        rows: list[PromptRow],
        *,
        prompts_per_rollout: int,
        n_samples_per_prompt: int,
        shuffle: bool,
        seed: int,
    ) -> None:
        if prompts_per_rollout < 1:
            raise ValueError(f"prompts_per_rollout must be >= 1, got {prompts_per_rollout}")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy SeedSequence), got {seed}")
        self.num_rollout_per_epoch = len(rows) // prompts_per_rollout
        if self.num_rollout_per_epoch == 0:
            raise ValueError(
                f"dataset has {len(rows)} rows, fewer than "
                f"prompts_per_rollout={prompts_per_rollout}"
            )
        self.rows = rows
        self.prompts_per_rollout = prompts_per_rollout
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self._epoch = 0
        self._offset = 0
        self._order = self.epoch_order(0)

    @property
    def epoch(self) -> int:
        """Epoch that the next rollout's prompts come from (0-based)."""
        return self._epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row order for `epoch`, a function of (seed, epoch) only."""
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return np.arange(len(self.rows))

    def _set_position(self, epoch: int, offset: int) -> None:
        """Move to (epoch, offset), rolling over when the epoch's rollouts are used up."""
        usable = self.num_rollout_per_epoch * self.prompts_per_rollout
        if offset + self.prompts_per_rollout > usable:
            epoch, offset = epoch + 1, 0
        if epoch != self._epoch:
            self._order = self.epoch_order(epoch)
        self._epoch, self._offset = epoch, offset

    def next_prompts(self) -> list[PromptRow]:
        """Return the next `prompts_per_rollout` rows and advance."""
        end = self._offset + self.prompts_per_rollout
        batch = [self.rows[int(i)] for i in self._order[self._offset:end]]
        self._set_position(self._epoch, end)
        return batch

    def group(self, row: PromptRow, group_index: int, n: int | None = None) -> list[Sample]:
        """The `n_samples_per_prompt` (or ``n``) Samples of one prompt. Each gets its own copies of the
        mutable row fields so that one sample's changes never leak to another."""
        return [
            Sample(
                group_index=group_index,
                prompt_index=row.index,
                sample_index=j,
                prompt=copy.deepcopy(row.prompt),
                label=copy.deepcopy(row.label),
                metadata=copy.deepcopy(row.metadata),
                prompt_ids=list(row.prompt_ids),
            )
            for j in range(self.n_samples_per_prompt if n is None else n)
        ]

    def next_samples(self) -> list[Sample]:
        """Return the next rollout's Samples, grouped by prompt (all samples of the first prompt first)."""
        return [s for k, row in enumerate(self.next_prompts()) for s in self.group(row, k)]

    def peek_groups(self) -> Iterator[list[Sample]]:
        """The groups of the rest of this epoch, in order, without advancing: a rollout that draws a
        varying number of them (dynamic sampling) then calls `advance` with how many it used."""
        for k, i in enumerate(self._order[self._offset:]):
            yield self.group(self.rows[int(i)], k)

    def advance(self, groups: int) -> None:
        """Move past `groups` prompts (at most the rest of the epoch); the next epoch starts when fewer
        than `prompts_per_rollout` are left."""
        if not 0 <= groups <= len(self.rows) - self._offset:
            raise ValueError(f"cannot advance {groups} prompts from offset {self._offset} of {len(self.rows)}")
        self._set_position(self._epoch, self._offset + groups)

    def state_dict(self) -> dict:
        """Position for checkpointing: {"epoch", "offset", "seed", "num_rows"}."""
        return {
            "epoch": self._epoch,
            "offset": self._offset,
            "seed": self.seed,
            "num_rows": len(self.rows),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by `state_dict`.

        Raises:
            ValueError: the state was saved for a different dataset size or seed
                (resuming would silently visit different prompts), or is malformed.
        """
        missing = {"epoch", "offset", "seed", "num_rows"} - set(state)
        if missing:
            raise ValueError(f"data source state is missing keys {sorted(missing)}")
        if state["num_rows"] != len(self.rows):
            raise ValueError(
                f"data source state was saved with num_rows={state['num_rows']} but "
                f"the dataset now has {len(self.rows)} rows; refusing to resume"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"data source state was saved with seed={state['seed']} but the "
                f"configured seed is {self.seed}; refusing to resume"
            )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= len(self.rows):
            raise ValueError(f"data source state has invalid epoch/offset: {epoch}/{offset}")
        self._epoch = epoch
        self._order = self.epoch_order(epoch)
        self._set_position(epoch, offset)
