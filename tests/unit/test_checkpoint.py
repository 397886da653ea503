"""Unit tests for the non-distributed parts of tether.run.checkpoint (layout, commit, finding the latest
complete checkpoint) and the learning-rate schedule of tether.trainer.optim."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tether.run.checkpoint import (
    LATEST,
    Checkpointer,
    checkpoint_name,
    commit,
    find_latest,
    is_complete,
    staging_dir,
)
from tether.config import TrainConfig
from tether.trainer.optim import build_optimizer, build_scheduler, lr_multiplier

CONFIG = {"seed": 3, "rollout": {"temperature": 0.7}}


def _fill(stage: Path) -> None:
    """What the trainer and rollout write into a staging directory."""
    (stage / "train").mkdir()
    (stage / "train" / ".metadata").write_bytes(b"dcp")
    (stage / "rank0.pt").write_bytes(b"rank0")
    (stage / "data_source.json").write_text(json.dumps({"epoch": 0, "offset": 4, "seed": 3}))


def _save(root: Path, rollout_id: int) -> Path:
    stage = staging_dir(root, rollout_id)
    _fill(stage)
    return commit(root, rollout_id, CONFIG)


def test_checkpoint_name():
    assert checkpoint_name(12) == "rollout_000012"
    assert checkpoint_name(0) == "rollout_000000"


def test_staging_and_commit_layout(tmp_path):
    root = tmp_path / "ckpts"
    stage = staging_dir(root, 12)
    assert stage == root / "rollout_000012.tmp" and stage.is_dir()
    _fill(stage)
    final = commit(root, 12, CONFIG)
    assert final == root / "rollout_000012"
    assert final.is_dir() and not stage.exists()
    assert (root / LATEST).read_text() == "rollout_000012\n"
    meta = json.loads((final / "meta.json").read_text())
    assert meta["rollout_id"] == 12 and meta["config"] == CONFIG and meta["time"] > 0
    assert is_complete(final)
    assert (final / "rank0.pt").read_bytes() == b"rank0"
    assert sorted(p.name for p in root.iterdir()) == [LATEST, "rollout_000012"]


def test_find_latest_empty_or_missing(tmp_path):
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "does-not-exist") is None


def test_find_latest_returns_newest(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 3)
    assert find_latest(tmp_path) == (tmp_path / "rollout_000003", 3)


def test_ids_order_numerically(tmp_path):
    _save(tmp_path, 9)
    _save(tmp_path, 10)
    (tmp_path / LATEST).unlink()  # force the directory scan
    assert find_latest(tmp_path) == (tmp_path / "rollout_000010", 10)


@pytest.mark.parametrize("missing", ["train/.metadata", "data_source.json", "meta.json"])
def test_incomplete_newest_is_ignored(tmp_path, missing):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 3)
    (newest / missing).unlink()
    assert not is_complete(newest)
    # `latest` names the broken one: fall back to the newest complete directory.
    assert (tmp_path / LATEST).read_text().strip() == "rollout_000003"
    assert find_latest(tmp_path) == (tmp_path / "rollout_000001", 1)


def test_incomplete_directory_without_pointer(tmp_path):
    _save(tmp_path, 1)
    broken = tmp_path / "rollout_000002"
    broken.mkdir()
    (broken / "meta.json").write_text(json.dumps({"rollout_id": 2}))
    (tmp_path / LATEST).unlink()
    assert find_latest(tmp_path) == (tmp_path / "rollout_000001", 1)


def test_staging_directory_is_ignored(tmp_path):
    _save(tmp_path, 1)
    # A crash mid-save of rollout 2 leaves a full-looking .tmp directory (meta.json included) behind.
    stage = staging_dir(tmp_path, 2)
    _fill(stage)
    (stage / "meta.json").write_text(json.dumps({"rollout_id": 2}))
    assert is_complete(stage)
    assert find_latest(tmp_path) == (tmp_path / "rollout_000001", 1)
    (tmp_path / LATEST).unlink()
    assert find_latest(tmp_path) == (tmp_path / "rollout_000001", 1)


def test_latest_pointing_at_broken_checkpoint_falls_back(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / LATEST).write_text("rollout_000007\n")  # names a directory that does not exist
    assert find_latest(tmp_path) == (tmp_path / "rollout_000002", 2)
    (tmp_path / LATEST).write_text("\n")
    assert find_latest(tmp_path) == (tmp_path / "rollout_000002", 2)


def test_latest_pointer_is_followed(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / LATEST).write_text("rollout_000001\n")
    assert find_latest(tmp_path) == (tmp_path / "rollout_000001", 1)


def test_staging_dir_clears_a_leftover(tmp_path):
    stage = staging_dir(tmp_path, 5)
    _fill(stage)
    (stage / "junk").write_text("partial")
    again = staging_dir(tmp_path, 5)
    assert again == stage and again.is_dir()
    assert list(again.iterdir()) == []


def test_commit_replaces_an_existing_checkpoint_of_the_same_rollout(tmp_path):
    first = _save(tmp_path, 4)
    (first / "old-only").write_text("x")
    second = _save(tmp_path, 4)
    assert second == first and not (second / "old-only").exists()
    assert is_complete(second)
    assert find_latest(tmp_path) == (second, 4)


def test_checkpointer_class(tmp_path):
    ckpt = Checkpointer(tmp_path / "c", CONFIG)
    stage = Path(ckpt.stage(0))
    assert stage.name == "rollout_000000.tmp"
    _fill(stage)
    final = ckpt.commit(0)
    assert final == str(tmp_path / "c" / "rollout_000000")
    assert find_latest(tmp_path / "c") == (Path(final), 0)


# --------------------------------------------------------------------------- #
# learning-rate schedule
# --------------------------------------------------------------------------- #


def test_warmup_is_linear():
    cfg = TrainConfig(lr=1e-3, warmup_steps=4)
    assert [lr_multiplier(s, cfg, total_steps=10) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_constant_schedule():
    cfg = TrainConfig(lr=1e-3, lr_schedule="constant")
    assert all(lr_multiplier(s, cfg, total_steps=5) == 1.0 for s in range(10))


def test_cosine_reaches_min_lr_at_the_end():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, lr_schedule="cosine", warmup_steps=2)
    total = 12
    values = [lr_multiplier(s, cfg, total) for s in range(total + 3)]
    assert values[:2] == pytest.approx([0.5, 1.0])  # warm-up
    assert values[2] == pytest.approx(1.0)  # cosine starts at the peak
    decay = values[2 : total + 1]
    assert all(a > b for a, b in zip(decay, decay[1:]))  # strictly decreasing
    assert values[total] == pytest.approx(0.1)  # min_lr / lr
    assert values[total + 2] == pytest.approx(0.1)  # and stays there
    # Half-way through the decay: the mean of peak and floor.
    assert values[2 + (total - 2) // 2] == pytest.approx(0.55)


def test_cosine_without_warmup_and_zero_floor():
    cfg = TrainConfig(lr=1.0, lr_schedule="cosine")
    total = 8
    for s in range(total + 1):
        assert lr_multiplier(s, cfg, total) == pytest.approx(0.5 * (1 + math.cos(math.pi * s / total)))
    assert lr_multiplier(total, cfg, total) == pytest.approx(0.0, abs=1e-12)


def test_scheduler_applies_the_multiplier():
    cfg = TrainConfig(lr=0.1, warmup_steps=2, lr_schedule="cosine", min_lr=0.01)
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.1 * lr_multiplier(s, cfg, 6) for s in range(6)])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)  # after the last step: min_lr


def test_prune_keeps_the_newest_complete(tmp_path):
    from tether.run.checkpoint import prune

    for rollout_id in range(5):
        _save(tmp_path, rollout_id)
    staging_dir(tmp_path, 5)  # an unfinished save is never counted or removed
    removed = prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["rollout_000002", "rollout_000001", "rollout_000000"]
    assert sorted(p.name for p in tmp_path.glob("rollout_*")) == ["rollout_000003", "rollout_000004", "rollout_000005.tmp"]
    assert find_latest(tmp_path) == (tmp_path / "rollout_000004", 4)


def test_checkpointer_keeps_metrics_row_and_prunes(tmp_path):
    ckpt = Checkpointer(tmp_path, CONFIG, keep_last=1, extra=lambda: {"tracker_run_id": "abc"})
    for rollout_id in range(3):
        _fill(Path(ckpt.stage(rollout_id)))
        ckpt.commit(rollout_id, {"step": rollout_id + 1, "rollout/reward_mean": 0.5})
    assert [p.name for p in tmp_path.glob("rollout_*")] == ["rollout_000002"]
    meta = json.loads((tmp_path / "rollout_000002" / "meta.json").read_text())
    assert meta["tracker_run_id"] == "abc" and meta["metrics_row"]["step"] == 3
    assert "data_source.json" in meta["manifest"]


def test_manifest_catches_a_truncated_file(tmp_path):
    from tether.run.checkpoint import problem

    path = _save(tmp_path, 0)
    assert problem(path) is None
    (path / "rank0.pt").write_bytes(b"ra")
    assert "rank0.pt has 2 bytes, 5 were written" in problem(path)


def test_prune_touches_only_this_runs_checkpoints(tmp_path):
    # An older run reached rollout 40; this run (another id) has saved 0..2 with keep_last=1.
    old = Checkpointer(tmp_path, CONFIG, keep_last=None, extra=lambda: {"tracker_run_id": "old"})
    for rollout_id in (20, 40):
        _fill(Path(old.stage(rollout_id)))
        old.commit(rollout_id)
    new = Checkpointer(tmp_path, CONFIG, keep_last=1, extra=lambda: {"tracker_run_id": "new"})
    for rollout_id in range(3):
        _fill(Path(new.stage(rollout_id)))
        new.commit(rollout_id)
    names = sorted(p.name for p in tmp_path.glob("rollout_*"))
    assert names == ["rollout_000002", "rollout_000020", "rollout_000040"]
    # latest names this run's newest, which exists.
    assert (tmp_path / "latest").read_text().strip() == "rollout_000002"
    assert find_latest(tmp_path) == (tmp_path / "rollout_000002", 2)
