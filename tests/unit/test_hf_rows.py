"""Hugging Face datasets as prompt sources: save_to_disk folders and Arrow files written by the real
`datasets` package, a DatasetDict's folder, and a Hub name that cannot be had (offline)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tether.models.tiny import build_char_tokenizer
from tether.rollout.data_source import load_prompt_rows, read_rows
from tether.rollout.prompt_format import DatasetError

datasets = pytest.importorskip("datasets")  # a dev dependency: installed wherever the suite runs

ROWS = [{"question": "1+1=", "answer": "2", "task": "add"}, {"question": "2+3=", "answer": "5", "task": "add"}]


def test_a_save_to_disk_folder_loads_with_its_columns(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    rows, _, _ = load_prompt_rows(tmp_path / "ds", build_char_tokenizer(), prompt_key="question", label_key="answer")
    assert [(r.prompt, r.label, r.metadata) for r in rows] == [("1+1=", "2", {"task": "add"}), ("2+3=", "5", {"task": "add"})]
    assert [w for _, w, _ in read_rows(tmp_path / "ds")] == [f"{tmp_path / 'ds'} row 1", f"{tmp_path / 'ds'} row 2"]


def test_a_datasetdict_folder_names_its_splits_and_a_split_folder_loads(tmp_path):
    whole = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": whole, "test": whole.select([0])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"a DatasetDict saved with save_to_disk; name one split's folder: .*dd/train"):
        list(read_rows(tmp_path / "dd"))
    assert [obj["answer"] for _, _, obj in read_rows(tmp_path / "dd" / "test")] == ["2"]


def test_an_arrow_file_loads(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    arrow = next((tmp_path / "ds").glob("*.arrow"))
    assert [obj for _, _, obj in read_rows(arrow)] == ROWS
    (tmp_path / "bad.arrow").write_text("not arrow")
    with pytest.raises(DatasetError, match=r"bad.arrow: not a readable Arrow file"):
        list(read_rows(tmp_path / "bad.arrow"))


def test_a_hub_dataset_that_cannot_be_had_says_so():
    code = ("from tether.rollout.data_source import read_rows\n"
            "try:\n    list(read_rows('hf://datasets/nobody/nothing-here', split='train', subset='main'))\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}).stdout
    assert out.startswith("DatasetError hf://datasets/nobody/nothing-here (split 'train', subset 'main'): cannot be "
                          "loaded from the local Hugging Face cache or the Hub"), out
