"""A rerun never destroys a run: a fresh start in a directory holding another run is refused, with
nothing changed, unless --overwrite; asking to resume a run that saved nothing replaces its logs."""

from __future__ import annotations

import json

import pytest

from tether.cli import main
from tether.config import config_from_dict
from tether.run.output_dir import RunDirError, claim
from tether.train import resolve_resume


def earlier_run(out):
    """What a finished run leaves: logs, samples, and two checkpoints with a latest pointer."""
    (out / "rollouts").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (out / "trained_samples.jsonl").write_text('{"rollout_id": 0, "sample_ids": []}\n')
    (out / "rollouts" / "rollout_000000.jsonl").write_text("{}\n")
    for name in ("rollout_000001", "rollout_000002"):
        (out / "checkpoints" / name).mkdir(parents=True)
        (out / "checkpoints" / name / "meta.json").write_text(json.dumps({"rollout_id": int(name[-1])}))
    (out / "checkpoints" / "latest").write_text("rollout_000002\n")
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def snapshot(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def cfg(out, **checkpoint):
    return config_from_dict({"output_dir": str(out), "model": {"path": "m"}, "checkpoint": checkpoint})


def test_fresh_start_over_an_earlier_run_is_refused_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    before = earlier_run(out)
    with pytest.raises(RunDirError) as err:
        resolve_resume(cfg(out), config_path="grpo.yaml")
    text = str(err.value)
    assert f"{out} holds an earlier run; nothing was changed" in text
    assert "metrics.jsonl" in text and "2 checkpoint(s)" in text and "newest rollout_000002" in text
    assert f"tether train --config grpo.yaml --load {out / 'checkpoints'}" in text
    assert "--overwrite" in text and f"output_dir={out}-2" in text
    assert snapshot(out) == before


def test_the_cli_says_so_and_exits_2(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "run"
    before = earlier_run(out)
    model = tiny_model_dir
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    code = main(["train", f"output_dir={out}", f"model.path={model}", f"data.path={data}", "rollout.max_response_len=8"])
    assert code == 2 and "holds an earlier run" in capsys.readouterr().err
    assert snapshot(out) == before


def test_overwrite_deletes_the_earlier_run(tmp_path):
    out = tmp_path / "run"
    earlier_run(out)
    (out / "hf").mkdir()  # an export is not a log: it stays until the new run replaces it
    assert resolve_resume(cfg(out), overwrite=True) == (None, 0, {})
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "hf"]
    assert list((out / "checkpoints").iterdir()) == []


def test_load_without_a_complete_checkpoint_replaces_the_logs(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # killed before its first checkpoint
    assert resolve_resume(cfg(out, load=str(out / "checkpoints")))[1] == 0
    assert not (out / "metrics.jsonl").exists()


def test_a_separate_checkpoint_dir_of_another_run_is_refused_too(tmp_path):
    shared = tmp_path / "shared_ckpts"
    earlier_run(tmp_path / "a")
    (shared / "rollout_000003").mkdir(parents=True)
    with pytest.raises(RunDirError, match="1 checkpoint"):
        claim(tmp_path / "b", shared, overwrite=False, command="train")
    assert claim(tmp_path / "fresh", tmp_path / "fresh" / "checkpoints", overwrite=False, command="train") == []
