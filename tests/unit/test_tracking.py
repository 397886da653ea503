"""Unit tests for tether.tracking: JSONL/TensorBoard/W&B sinks, console lines, plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tether.tracking import (
    Tracker,
    format_rollout_line,
    format_summary,
    plot_curves,
    read_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never let any test talk to W&B servers or write outside tmp."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def _tracker(out: Path, **kwargs: Any) -> Tracker:
    defaults: dict[str, Any] = dict(run_name="test", config={"lr": 1e-4}, tensorboard=False,
                                    console=False)
    return Tracker(out, **{**defaults, **kwargs})


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _step_metrics(step: int) -> dict[str, float]:
    m = {"rollout/reward_mean": 0.1 * step, "rollout/reward_std": 0.05,
         "rollout/response_len_mean": 20.0 - step, "train/loss": -0.01 * step,
         "train/kl": 1e-3 * step}
    if step % 2 == 0:
        m["eval/arith/score"] = [0.2, 0.6, 0.5][step // 2]
    return m


# ------------------------------------------------------------------ JSONL


def test_jsonl_rows_and_config(tmp_path: Path) -> None:
    with _tracker(tmp_path / "run", config={"lr": 1e-4, "path": Path("/x")}) as t:
        t.log(0, {"rollout/reward_mean": 0.5, "train/loss": 1})
        t.log(1, {"rollout/reward_mean": np.float32(0.75), "train/loss": torch.tensor(2.5),
                  "rollout/response_len_max": np.int64(7)})
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(isinstance(r["time"], float) for r in rows)
    assert rows[1]["rollout/reward_mean"] == pytest.approx(0.75)
    assert rows[1]["train/loss"] == 2.5 and rows[1]["rollout/response_len_max"] == 7
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config == {"lr": 1e-4, "path": "/x"}


def test_jsonl_appends_on_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _tracker(out)
    first.log(0, {"rollout/reward_mean": 0.1})
    first.log(1, {"rollout/reward_mean": 0.2})
    first.finish()
    second = _tracker(out, resume_run_id=first.run_id)
    assert second.run_id == first.run_id
    second.log(2, {"rollout/reward_mean": 0.3})
    summary = second.finish()
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == [0, 1, 2]
    # The resumed run's summary covers the whole run, not just the second session.
    assert summary["metrics"]["rollout/reward_mean"]["first"] == pytest.approx(0.1)
    assert summary["metrics"]["rollout/reward_mean"]["last"] == pytest.approx(0.3)


def test_nan_written_as_null_and_logging_continues(tmp_path: Path) -> None:
    with _tracker(tmp_path / "run", tensorboard=True) as t:
        t.log(0, {"train/loss": float("nan"), "train/kl": float("inf"), "train/lr": 1e-4})
        t.log(1, {"train/loss": torch.tensor(float("nan")), "train/kl": 0.5})
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["train/loss"] is None and rows[0]["train/kl"] is None
    assert rows[0]["train/lr"] == 1e-4 and rows[1]["train/kl"] == 0.5


def test_rejects_bad_values(tmp_path: Path) -> None:
    with _tracker(tmp_path / "run") as t:
        with pytest.raises(TypeError, match="train/loss"):
            t.log(0, {"train/loss": "high"})
        with pytest.raises(TypeError, match="scalar"):
            t.log(0, {"train/loss": torch.ones(3)})
        with pytest.raises(ValueError, match="reserved"):
            t.log(0, {"step": 3})


def test_read_metrics_merges_same_step(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"step": 1, "a": 1.0}\n{"step": 0, "a": 0.0}\n{"step": 1, "b": 2.0}\n'
        '{"step": 1, "a": 3.0}\n\n{"step": 2, "a": 4\n'  # last line truncated by a crash
    )
    assert read_metrics(path) == [{"step": 0, "a": 0.0}, {"step": 1, "a": 3.0, "b": 2.0}]


# ------------------------------------------------------------------ TensorBoard


def test_tensorboard_event_file_has_scalar(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _tracker(tmp_path / "run", tensorboard=True) as t:
        for step in range(3):
            t.log(step, {"rollout/reward_mean": 0.25 * step})
    tb_dir = tmp_path / "run" / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert "rollout/reward_mean" in acc.Tags()["scalars"]
    events = acc.Scalars("rollout/reward_mean")
    assert [e.step for e in events] == [0, 1, 2]
    assert [e.value for e in events] == pytest.approx([0.0, 0.25, 0.5])


# ------------------------------------------------------------------ W&B


def test_wandb_offline_run_directory(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    with _tracker(out, wandb=True, resume_run_id="abc123xy") as t:
        t.log(0, {"rollout/reward_mean": 0.5})
        t.log(1, {"rollout/reward_mean": float("nan")})
    run_dirs = list((out / "wandb").glob("offline-run-*-abc123xy"))
    assert len(run_dirs) == 1
    assert list(run_dirs[0].glob("*.wandb"))


def test_wandb_missing_gives_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"pip install .wandb>=0.17."):
        _tracker(tmp_path / "run", wandb=True)


# ------------------------------------------------------------------ console


def test_rollout_line_full() -> None:
    metrics = {
        "rollout/reward_mean": 0.734, "rollout/reward_std": 0.21,
        "rollout/response_len_mean": 5.1, "train/loss": -0.012, "train/pg_loss": -0.013,
        "train/kl": 0.0003, "train/entropy": 0.82, "train/grad_norm": 0.41, "train/lr": 1e-4,
        "mismatch/logprob_abs_diff_mean": 2e-7, "eval/arith/score": 0.81,
        "timing/generate_s": 1.2, "timing/train_s": 0.8, "timing/weight_sync_s": 0.1,
    }
    assert format_rollout_line(12, 60, metrics) == (
        "[rollout 11, step 12/60] reward 0.734±0.21 len 5.1 loss -0.012 pg -0.013 kl 0.0003 "
        "ent 0.82 gn 0.41 lr 1.0e-04 mismatch 2e-07 | eval arith 0.81 | "
        "gen 1.2s train 0.8s sync 0.1s"
    )


def test_rollout_line_only_present_keys() -> None:
    line = format_rollout_line(3, 10, {"train/loss": 0.5, "rollout/reward_mean": 0.25,
                                       "some/unknown": 1.0})
    assert line == "[rollout 2, step 3/10] reward 0.250 loss 0.5"
    assert "eval" not in line and "|" not in line and "±" not in line
    assert format_rollout_line(4, None, {}) == "[rollout 3, step 4]"
    assert format_rollout_line(0, 9, {}) == "[step 0/9, before training]"
    assert format_rollout_line(4, 9, {}, "sft step") == "[sft step 4/9]"


def test_rollout_line_eval_sections() -> None:
    line = format_rollout_line(5, 10, {"eval/gsm/score": 0.4, "eval/arith/score": 0.9,
                                       "eval/arith/response_len_mean": 12.0,
                                       "timing/save_s": 2.0})
    assert line == "[rollout 4, step 5/10] eval arith 0.9 gsm 0.4 | save 2.0s"
    assert "loss nan" in format_rollout_line(1, 2, {"train/loss": float("nan")})
    assert "loss 0 " in format_rollout_line(1, 2, {"train/loss": -0.0, "train/kl": 0.1})


def test_console_output_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _tracker(tmp_path / "run", console=True) as t:
        bar = t.progress(2, "rollouts")
        t.log(0, {"rollout/reward_mean": 0.5})
        bar.update()
    out = capsys.readouterr().out
    assert "[step 0/2, before training] reward 0.500" in out
    assert "tether run summary: test" in out


def test_format_summary_box() -> None:
    text = format_summary({
        "run_name": "demo", "run_id": "r1", "first_step": 0, "last_step": 9, "num_steps": 10,
        "metrics": {"rollout/reward_mean": {"first": 0.1, "last": 0.7},
                    "eval/arith/score": {"first": None, "last": 0.5}},
        "best_eval": {"arith": {"score": 0.8, "step": 6}},
        "elapsed_s": 125.0, "plot": "curves.png",
    })
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1  # a closed rectangle
    assert lines[0].startswith("+-") and lines[-1] == lines[0]
    assert "demo (id r1)" in text and "+0.6" in text and "2m05s" in text
    assert "arith" in text and "0.8" in text and "curves.png" in text
    assert format_summary({}).count("\n") >= 2  # tolerates an empty summary


# ------------------------------------------------------------------ summary & plot


def test_summary_values(tmp_path: Path) -> None:
    t = _tracker(tmp_path / "run")
    for step in range(5):
        t.log(step, _step_metrics(step))
    s = t.summary()
    assert (s["first_step"], s["last_step"], s["num_steps"]) == (0, 4, 5)
    assert s["metrics"]["rollout/reward_mean"]["first"] == pytest.approx(0.0)
    assert s["metrics"]["rollout/reward_mean"]["last"] == pytest.approx(0.4)
    assert s["metrics"]["rollout/response_len_mean"]["last"] == pytest.approx(16.0)
    assert s["metrics"]["eval/arith/score"]["last"] == pytest.approx(0.5)
    assert s["best_eval"] == {"arith": {"score": pytest.approx(0.6), "step": 2}}
    final = t.finish()
    assert final["plot"] == str(tmp_path / "run" / "curves.png")
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["best_eval"]["arith"]["step"] == 2
    assert t.finish() is final  # idempotent
    with pytest.raises(RuntimeError):
        t.log(9, {"train/loss": 0.0})


def test_summary_without_jsonl(tmp_path: Path) -> None:
    with _tracker(tmp_path / "run", jsonl=False) as t:
        t.log(0, {"rollout/reward_mean": 0.2})
        t.log(0, {"eval/arith/score": 0.3})  # eval logged separately at the same step
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert summary["num_steps"] == 1 and summary["best_eval"]["arith"]["score"] == 0.3


def _assert_png(path: Path, min_bytes: int = 5_000) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > min_bytes


def test_plot_curves_full(tmp_path: Path) -> None:
    t = _tracker(tmp_path / "run")
    for step in range(5):
        t.log(step, _step_metrics(step))
    t.finish()
    _assert_png(tmp_path / "run" / "curves.png")
    out = plot_curves(tmp_path / "run" / "metrics.jsonl", tmp_path / "sub" / "again.png")
    assert out == tmp_path / "sub" / "again.png"
    _assert_png(out)


@pytest.mark.parametrize("row", [
    {"step": 0, "rollout/reward_mean": 0.5},
    {"step": 0, "eval/arith/score": 0.5, "train/loss": None},
    {"step": 0, "something/else": 1.0},
])
def test_plot_curves_single_row_and_missing_panels(tmp_path: Path, row: dict[str, Any]) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(row) + "\n")
    _assert_png(plot_curves(path, tmp_path / "curves.png"), min_bytes=2_000)


def test_warnings_stand_out_and_reach_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _tracker(tmp_path / "run", console=True) as t:
        t.warn("the prompts do not survive the tokenizer\n  train.jsonl:3 prompt: 'a b' comes back as 'ab'")
        t.log(1, {"rollout/reward_mean": 0.0, "warnings": ["all 16 rewards of rollout 0 are 0.0\n  example ..."]})
        summary = t.finish()
    err = capsys.readouterr().err
    assert "!! WARNING:\n!!   the prompts do not survive" in err
    assert "!! WARNING at rollout 0, step 1:\n!!   all 16 rewards of rollout 0 are 0.0" in err
    assert [w["step"] for w in summary["warnings"]] == [None, 1]
    assert "warnings" not in _rows(tmp_path / "run" / "metrics.jsonl")[0]  # never a metric
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["warnings"][1]["message"].startswith("all 16 rewards")
    box = format_summary(summary)
    assert "WARNINGS (2); the full texts are in summary.json" in box and "step 1: all 16 rewards" in box


def test_plot_panels_keep_a_01_reward_in_range_and_show_the_constant_answer() -> None:
    from matplotlib.figure import Figure

    from tether.tracking.plot import _panel_eval, _panel_reward

    rows = [{"step": k, "rollout/reward_mean": 0.2 + 0.1 * k, "rollout/reward_std": 0.45,
             "eval/add2/score": 0.3 + 0.2 * k, "eval/add2/constant_answer_score": 0.05} for k in range(3)]
    reward, evals = Figure().subplots(1, 2)
    _panel_reward(reward, rows)
    _panel_eval(evals, rows)
    lows = [min(line.get_ydata()) for line in reward.get_lines()]
    assert not reward.collections and min(lows) >= 0  # no mean +- std band below 0
    labels = [line.get_label() for line in evals.get_lines()]
    assert labels == ["add2", "add2: one constant answer"]
    assert list(evals.get_lines()[1].get_ydata()) == [0.05] * 3
