"""Rows of Hugging Face datasets, as users have them: a folder written by ``Dataset.save_to_disk``, an
Arrow file, or a dataset on the Hub named ``hf://datasets/<owner>/<name>`` (with ``split`` and
``subset``; resolved from the local cache, downloaded when the network allows; needs the ``datasets``
package). JSONL and Parquet files are read by tether/rollout/data_source.py; this module reads the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from tether.rollout.prompt_format import DatasetError

HUB = "hf://datasets/"


def is_hub(path: str | Path) -> bool:
    return str(path).startswith(HUB)


def is_hf_source(path: Path) -> bool:
    """A source this module reads: a save_to_disk folder (or a DatasetDict's), or an Arrow file."""
    return path.suffix == ".arrow" or (path.is_dir() and any((path / f).is_file()
                                                              for f in ("state.json", "dataset_dict.json")))


def read_hf_rows(path: str | Path, split: str | None = None, subset: str | None = None) -> Iterator[tuple[int, str, dict]]:
    """(1-based row number, where, row) of each row."""
    if is_hub(path):
        yield from _hub(str(path), split or "train", subset)
        return
    path = Path(path)
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DatasetError(f"{path}: a DatasetDict saved with save_to_disk; name one split's folder: "
                           + " or ".join(str(path / s) for s in splits))
    files = _arrow_files(path)
    n = 0
    for file in files:
        for row in _arrow_table(file).to_pylist():
            n += 1
            yield n, f"{path} row {n}", row


def _arrow_files(path: Path) -> list[Path]:
    if path.suffix == ".arrow":
        return [path]
    try:
        state = json.loads((path / "state.json").read_text())
        return [path / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{path}: not a folder written by Dataset.save_to_disk (its state.json: {exc})") from None


def _arrow_table(file: Path):
    import pyarrow as pa

    for open_ in (pa.ipc.open_stream, pa.ipc.open_file):  # save_to_disk writes the stream format
        try:
            with pa.memory_map(str(file)) as source:
                return open_(source).read_all()
        except (pa.ArrowInvalid, OSError):
            continue
    raise DatasetError(f"{file}: not a readable Arrow file (stream or file format)")


def _hub(path: str, split: str, subset: str | None) -> Iterator[tuple[int, str, dict]]:
    name = path[len(HUB):].strip("/")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{path}: a Hugging Face Hub dataset needs the datasets package (pip install datasets); "
                           "or save it with save_to_disk / to Parquet and name that") from None
    what = f"{path} (split {split!r}" + (f", subset {subset!r})" if subset else ")")
    try:
        data = datasets.load_dataset(name, subset, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; each is said as it is
        raise DatasetError(f"{what}: cannot be loaded from the local Hugging Face cache or the Hub: "
                           f"{type(exc).__name__}: {str(exc)[:400]}") from None
    for n, row in enumerate(data, start=1):
        yield n, f"{path}[{split}] row {n}", dict(row)
