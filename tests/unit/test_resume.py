"""Which config changes a resume accepts, and trimming logs back to a checkpoint."""

from __future__ import annotations

import json

import pytest

from tether.config import ConfigError, config_from_dict
from tether.run.resume import changed_fields, check_resume_config, trim_jsonl


def dumped(**sections) -> dict:
    raw = {"model": {"path": "m"}, **sections}
    return config_from_dict(raw).model_dump(mode="json")


def test_harmless_changes_are_accepted():
    saved = dumped()
    now = dumped(rollout={"num_rollout": 50}, eval={"interval": 3}, tracking={"wandb": True},
                 cluster={"num_train_actors": 2}, checkpoint={"load": "x", "save_interval": 5},
                 train={"micro_batch_size": 2}, output_dir="elsewhere")
    check_resume_config(saved, now, "ckpt")


def test_breaking_changes_are_listed_with_both_values():
    saved = dumped()
    now = dumped(model={"path": "other"}, rollout={"n_samples_per_prompt": 4}, seed=3)
    with pytest.raises(ConfigError) as err:
        check_resume_config(saved, now, "runs/x/checkpoints/rollout_000004")
    text = str(err.value)
    assert "runs/x/checkpoints/rollout_000004" in text
    assert "model.path: 'm' in the checkpoint, 'other' now" in text
    assert "rollout.n_samples_per_prompt: 8 in the checkpoint, 4 now" in text
    assert "seed: 0 in the checkpoint, 3 now" in text
    assert "allow_config_change" in text


def test_allow_config_change_lets_a_named_field_through():
    saved = dumped()
    now = dumped(train={"lr": 1e-5}, checkpoint={"allow_config_change": ["train.lr"]})
    check_resume_config(saved, now, "ckpt")
    with pytest.raises(ConfigError, match="train.lr"):
        check_resume_config(saved, dumped(train={"lr": 1e-5}), "ckpt")


def test_prefix_rules_do_not_overmatch():
    saved = dumped()
    now = dumped(rollout={"num_rollout": 3, "n_samples_per_prompt": 2})
    changes = changed_fields(saved, now)
    assert set(changes) == {"rollout.num_rollout", "rollout.n_samples_per_prompt"}
    with pytest.raises(ConfigError) as err:
        check_resume_config(saved, now, "ckpt")
    assert "num_rollout" not in str(err.value)


def test_trim_jsonl_keeps_rows_and_drops_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "tr')
    dropped = trim_jsonl(path, lambda row: row["step"] <= 3)
    assert dropped == 3  # steps 4 and 5, and the line the crash cut
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    assert trim_jsonl(tmp_path / "absent.jsonl", lambda row: True) == 0
