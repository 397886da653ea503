"""Every prompt row is checked before a run starts: file and line for each bad one, or skipped and
counted with data.skip_bad_rows."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tether.cli import main
from tether.rollout.data_source import DatasetError, RowChecks, load_prompt_rows
from tether.models.tiny import build_char_tokenizer

GOOD = {"prompt": "1+2=", "label": "3"}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def write(path: Path, lines: list) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


CHECKS = RowChecks(max_positions=16, max_response_len=6, label_types=(str, int, float), reward="exact_match")
BAD_ROWS = [
    ({"prompt": "", "label": "1"}, "the prompt is empty"),
    ({"prompt": "9" * 11, "label": "1"}, "needs 17 positions, the model has 16"),
    ({"prompt": "1+2=", "label": ["3"]}, "field 'label' is a list; reward exact_match scores a str or int or float"),
    ({"prompt": "1+2=", "label": {"a": 1}}, "is a dict"),
    ({"question": "1+2="}, "missing prompt key 'prompt'"),
    ({"prompt": 12}, "must be a string or a list of chat messages"),
    ({"prompt": "1+2=", "metadata": [1]}, "field 'metadata' must be a JSON object"),
    (b'{"prompt": "1+2=", ', "invalid JSON"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'{"prompt": "\xff\xfe"}', "not UTF-8 text"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS, ids=[m for _, m in BAD_ROWS])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, tok, row, message):
    path = write(tmp_path / "d.jsonl", [GOOD, GOOD, row, GOOD])
    with pytest.raises(DatasetError) as info:
        load_prompt_rows(path, tok, checks=CHECKS)
    assert f"{path}:3:" in str(info.value) and message in str(info.value)


def test_skip_bad_rows_skips_and_counts_every_kind(tmp_path, tok):
    path = write(tmp_path / "d.jsonl", [GOOD] + [row for row, _ in BAD_ROWS] + [GOOD])
    checks = RowChecks(**{**CHECKS.__dict__, "skip_bad_rows": True})
    rows, filtered, skipped = load_prompt_rows(path, tok, checks=checks)
    assert len(rows) == 2 and filtered == 0 and len(skipped) == len(BAD_ROWS)
    assert [r.line for r in rows] == [1, len(BAD_ROWS) + 2]  # lines as in the file
    assert all(f"{path}:{i + 2}:" in line for i, line in enumerate(skipped))


def test_max_prompt_len_drops_before_the_positions_check(tmp_path, tok):
    path = write(tmp_path / "d.jsonl", [GOOD, {"prompt": "9" * 11, "label": "1"}])
    rows, filtered, skipped = load_prompt_rows(path, tok, max_prompt_len=8, checks=CHECKS)
    assert len(rows) == 1 and filtered == 1 and skipped == []


def test_a_user_reward_takes_any_label(tmp_path, tok):
    path = write(tmp_path / "d.jsonl", [{"prompt": "1+2=", "label": ["3", "three"]}])
    rows, _, _ = load_prompt_rows(path, tok, checks=RowChecks(max_positions=16, label_types=None))
    assert rows[0].label == ["3", "three"]


def test_only_bad_rows_is_an_error_even_when_skipping(tmp_path, tok):
    path = write(tmp_path / "d.jsonl", [{"prompt": ""}, b"oops"])
    with pytest.raises(DatasetError, match="all 2 rows are bad"):
        load_prompt_rows(path, tok, checks=RowChecks(skip_bad_rows=True))


def test_tether_train_reports_a_bad_row_before_ray_starts(tmp_path, tiny_model_dir, capsys, monkeypatch):
    import tether.cluster

    # Another test may have left a Ray session up, so "Ray is not initialised" cannot be the check:
    # starting Ray at all is the failure.
    def no_ray(*args, **kwargs):
        raise AssertionError("start_ray was called before the data was checked")

    monkeypatch.setattr(tether.cluster, "start_ray", no_ray)
    data = write(tmp_path / "train.jsonl", [GOOD] * 8 + [{"prompt": "1+2=", "label": [3]}])
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {tiny_model_dir}}}\ndata: {{path: {data}}}\n"
                   f"output_dir: {tmp_path / 'out'}\nrollout: {{reward: exact_match, max_response_len: 4}}\n")
    start = time.monotonic()
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{data}:9: field 'label' is a list" in err
    assert time.monotonic() - start < 20
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_verl_rows_give_their_nested_label_and_a_missing_label_key_is_named(tok, tmp_path):
    # verl keeps the answer at reward_model.ground_truth: a dotted data.label_key reaches it.
    rows = [{"data_source": "gsm8k", "prompt": "1+2=", "reward_model": {"style": "rule", "ground_truth": "3"}},
            {"prompt": "2+2=", "reward_model.ground_truth": "4"}]  # a flat key with a dot is taken as it is
    path = write(tmp_path / "verl.jsonl", rows)
    loaded = load_prompt_rows(path, tok, label_key="reward_model.ground_truth", checks=CHECKS)
    assert [r.label for r in loaded.rows] == ["3", "4"]
    # A label key the config names (or a reward that compares labels) that a row lacks stops the load,
    # naming the row, instead of scoring every sample against None.
    required = RowChecks(label_required=True, reward="exact_match")
    write(path, [rows[0], {"prompt": "2+2=", "reward_model": {"style": "rule"}}])
    with pytest.raises(DatasetError, match=r"verl.jsonl:2: no field 'reward_model.ground_truth' \(data.label_key\) "
                                           r"for reward exact_match; keys present: \['prompt', 'reward_model'\]"):
        load_prompt_rows(path, tok, label_key="reward_model.ground_truth", checks=required)
    assert load_prompt_rows(path, tok, label_key="reward_model.ground_truth", checks=CHECKS).rows[1].label is None


def test_the_config_says_when_labels_are_required():
    from tether.config import config_from_dict
    from tether.rollout.data_checks import row_checks

    def required(data: dict, reward: str) -> bool:
        cfg = config_from_dict({"model": {"path": "m"}, "data": data, "rollout": {"reward": reward}})
        return row_checks(cfg, reward, 8, None).label_required

    assert required({}, "math") and required({}, "exact_match")
    assert not required({}, "reward.py:score") and not required({}, "reasoning_gym")
    assert required({"label_key": "answer"}, "reward.py:score")
