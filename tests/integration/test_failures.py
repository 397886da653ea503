"""What a run says when something breaks: a NaN loss is stopped before any checkpoint or push, and a
dead engine is reported as a dead engine, with Ray's reason and the tail of its log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from tether.run.checkpoint import find_latest
from tether.config import config_from_dict
from tether.train import train
from tether.trainer.nonfinite import NonFiniteError

pytestmark = pytest.mark.integration
USER_LOSS = Path(__file__).parent / "user_loss.py"
USER_GENERATE = Path(__file__).parent / "user_generate.py"


def test_a_nan_loss_stops_before_any_checkpoint_or_push(ray_session, tiny_model_dir, addition_data, tmp_path):
    out = tmp_path / "run"
    raw = tiny_config(tiny_model_dir, addition_data, out, algorithm={"policy_loss": f"{USER_LOSS}:nan_after_first_rollout"},
                      checkpoint={"save_interval": 1})
    with pytest.raises(NonFiniteError) as err:
        train(config_from_dict(raw))
    text = str(err.value)
    assert "rollout 1, optimizer step 1/2: non-finite step (loss terms:" in text and "pg_loss=nan" in text
    assert "the gradient of" in text and "nothing was saved or pushed" in text
    # Rollout 0 was saved and pushed (weight version 1); rollout 1 reached neither.
    assert find_latest(out / "checkpoints")[1] == 0
    assert not (out / "checkpoints" / "rollout_000001").exists() and not (out / "hf").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]


def test_a_dead_engine_is_reported_with_its_exit_reason_and_log(ray_session, tiny_model_dir, addition_data, tmp_path):
    import os
    import signal

    from tether.cluster import plan_placement
    from tether.rollout.handle import EngineDiedError, RolloutHandle, create_engines

    cfg = config_from_dict(tiny_config(tiny_model_dir, addition_data, tmp_path / "run"))
    placement = plan_placement(cfg.cluster)
    engines = create_engines(cfg, placement)
    rollout = RolloutHandle(cfg, engines)
    try:
        rollout.generate(0)  # alive: works
        os.kill(rollout.engine_pids[0], signal.SIGKILL)
        with pytest.raises(EngineDiedError) as err:
            rollout.generate(1)
        text = str(err.value)
        assert text.startswith("rollout.generate(rollout 1) failed because an engine process died:")
        assert f"engine 0 (pid {rollout.engine_pids[0]}) died: SYSTEM_ERROR" in text
        assert "last lines of" in text and f"-{rollout.engine_pids[0]}.err" in text
        assert "lost the connection to http://127.0.0.1:" in text  # the error it caused, said plainly
    finally:
        rollout.shutdown()
        placement.remove()


@pytest.fixture()
def small_disk(tmp_path):
    """Make a tmpfs of a given size (a real file system that fills up); skipped where mounting is not
    permitted (no root / no CAP_SYS_ADMIN)."""
    import subprocess

    mounts = []

    def make(size_kb: int) -> Path:
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs to fill up here: {done.stderr.strip()}")
        mounts.append(path)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", str(path)], capture_output=True)


def test_a_save_on_a_full_disk_keeps_the_previous_checkpoint(ray_session, tiny_model_dir, addition_data, tmp_path,
                                                             small_disk):
    from tether.errors import CheckpointSaveError

    probe = tmp_path / "probe"
    train(config_from_dict(tiny_config(tiny_model_dir, addition_data, probe, rollout={"num_rollout": 1},
                                       checkpoint={"save_interval": 1})))
    size_kb = sum(f.stat().st_size for f in (probe / "checkpoints").rglob("*") if f.is_file()) // 1024
    disk = small_disk(int(size_kb * 1.5) + 64)  # room for one checkpoint (and 16 pages of slack), not two
    out = tmp_path / "run"
    raw = tiny_config(tiny_model_dir, addition_data, out, rollout={"num_rollout": 3},
                      checkpoint={"save_interval": 1, "save_dir": str(disk)})
    with pytest.raises(CheckpointSaveError) as err:
        train(config_from_dict(raw))
    text = str(err.value)
    # torch's writer may say "No space left on device" or fail its own size check first: the file is named either way
    assert "the checkpoint of rollout 1 was not saved" in text and "rollout_000001.tmp/train failed" in text
    assert str(disk) in text and "rollout_000000 is still the latest" in text
    path, rollout_id = find_latest(disk)
    assert rollout_id == 0 and not list(disk.glob("*.tmp"))  # the failed one is gone, its space free again
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] >= 1  # the run's log up to the failure is kept


def test_a_run_with_injected_tool_and_reward_faults_finishes_and_dumps_them(ray_session, tiny_model_dir, addition_data,
                                                                         tmp_path, monkeypatch):
    """30% of tool and reward calls fail (seeded): most are retried away, the rest are masked and dumped."""
    from tether.run.faults import INJECT_FAULTS

    monkeypatch.setenv(INJECT_FAULTS, "tool=0.3,reward=0.3,seed=2")
    out = tmp_path / "run"
    raw = tiny_config(tiny_model_dir, addition_data, out, checkpoint={"save_interval": 100},
                      rollout={"num_rollout": 2, "max_response_len": 6, "custom_generate_fn": f"{USER_GENERATE}:calls_a_tool",
                               "failures": {"max_attempts": 2, "max_failed_frac": 0.5, "min_trained_frac": 0.5}})
    train(config_from_dict(raw))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "failures/samples" in r]
    assert len(trained) == 2
    assert sum(r["failures/retried/tool"] + r["failures/retried/reward"] for r in trained) > 0
    failed = [json.loads(line) for path in sorted((out / "rollouts").glob("rollout_*_failures.jsonl"))
              for line in path.read_text().splitlines()]
    assert sum(r["failures/samples"] for r in trained) == len(failed) > 0  # every failure is in a dump
    assert {f["failure"]["kind"] for f in failed} <= {"tool", "reward"}
    assert all(f["failure"]["attempts"] == 2 and "injected fault" in f["failure"]["error"] and f["reward"] is None
               and f["remove"] for f in failed)
    for r in trained:
        assert r["rollout/trained_frac"] == 1 - r["failures/samples"] / 16


def test_trajectories_in_segments_train_together(ray_session, tiny_model_dir, addition_data, tmp_path):
    """A generate function returning two segments for some samples (a sub-agent's): groups of 6 samples
    and 4 trajectories train, each optimizer step taking whole trajectories."""
    out = tmp_path / "run"
    raw = tiny_config(tiny_model_dir, addition_data, out, checkpoint={"save_interval": 100},
                      rollout={"num_rollout": 2, "custom_generate_fn": f"{USER_GENERATE}:with_sub_agent"})
    train(config_from_dict(raw))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/optimizer_steps" in r]
    assert [r["train/optimizer_steps"] for r in trained] == [2.0, 2.0]  # 16 trajectories, 8 per step
    assert all(r["rollout/samples"] == 24.0 for r in trained)  # 4 prompts x (2 trajectories x 2 segments + 2)
    dump = [json.loads(line) for line in (out / "rollouts" / "rollout_000000.jsonl").read_text().splitlines()]
    per_group = {}
    for row in dump:
        per_group.setdefault(row["group_index"], []).append(row["sample_index"])
    assert all(sorted(v) == [0, 0, 1, 2, 2, 3] for v in per_group.values())
