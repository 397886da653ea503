"""A run killed with SIGKILL at any point and resumed with --load ends exactly like an uninterrupted one.

Each run is a real `tether train` process in its own process group; `TETHER_CRASH_AT` kills that
group at a chosen point. In deterministic mode the resumed chain must train on the same samples in
the same order and reach bitwise identical weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import tiny_config
from tether.run.checkpoint import find_latest
from tether.models.export import export_checkpoint
from tether.rollout.data_source import DataSource
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

# 12 prompts, 4 per rollout: epochs end after rollouts 2 and 5. save_interval 2 adds rollouts 1 and 3.
NUM_ROLLOUT = 6


def write_config(tmp_path: Path, model_dir: Path, data: dict, name: str, rollout: dict | None = None,
                 deterministic: bool = True, **cluster) -> Path:
    train = tmp_path / "train12.jsonl"
    if not train.exists():
        rows = data["train"].read_text().splitlines()[:12]
        train.write_text("\n".join(rows) + "\n")
    raw = tiny_config(model_dir, {**data, "train": train}, tmp_path / name,
                      rollout={"num_rollout": NUM_ROLLOUT, **(rollout or {})}, checkpoint={"save_interval": 2},
                      cluster={"torch_threads": 1, **cluster}, eval={"interval": None, "datasets": []})
    raw["deterministic"] = deterministic
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def tether_train(config: Path, crash_at: str | None = None, load: Path | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if crash_at:
        env["TETHER_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "tether.cli", "train", "--config", str(config)]
    if load:
        cmd += ["--load", str(load)]
    # Its own session: the crash kills this run's process group and nothing else.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, start_new_session=True, timeout=600,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    expected = -9 if crash_at else 0  # SIGKILL of the process group at the crash point
    if proc.returncode != expected:
        what = f"meant to be killed at {crash_at}" if crash_at else "meant to finish"
        raise AssertionError(f"tether train ({what}) exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    # The local cluster's token authentication is set explicitly: Ray has nothing to warn about.
    assert "Token authentication is enabled" not in proc.stdout
    if not crash_at:  # the start-up breakdown, printed once before the first rollout
        assert proc.stdout.count("[tether] ready in ") == 1, proc.stdout[-3000:]
    return proc.returncode


def trained(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trained_samples.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "hf" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir, addition_data):
    tmp = tmp_path_factory.mktemp("straight")
    config = write_config(tmp, tiny_model_dir, addition_data, "straight")
    tether_train(config)
    return tmp / "straight", tmp, config


def test_deterministic_runs_are_bitwise_identical(straight, tiny_model_dir, addition_data):
    out, tmp, _ = straight
    again = write_config(tmp, tiny_model_dir, addition_data, "again")
    tether_train(again)
    assert trained(tmp / "again") == trained(out)
    assert_same_weights(weights(tmp / "again"), weights(out))


def test_killed_anywhere_resumes_exactly(straight, tiny_model_dir, addition_data):
    out, tmp, _ = straight
    config = write_config(tmp, tiny_model_dir, addition_data, "chain")
    chain, ckpts = tmp / "chain", tmp / "chain" / "checkpoints"
    # Each crash is followed by a resume that itself crashes at the next point; the last one finishes.
    crashes = [
        "save:1",       # during the first save: nothing complete yet, so the resume starts over
        "committed:2",  # right after the checkpoint at the epoch boundary
        "generate:3",   # generating the first rollout of epoch 1
        "train:3",      # training on it
        "push:3",       # pushing weights after it (its checkpoint is complete by then)
        "committed:5",  # after the last save, before the export
    ]
    for point in crashes:
        code = tether_train(config, crash_at=point, load=ckpts)
        assert code == -9, f"the run was meant to be killed at {point}, exit code {code}"
    tether_train(config, load=ckpts)
    assert find_latest(ckpts)[1] == NUM_ROLLOUT - 1
    assert trained(chain) == trained(out)  # nothing skipped, nothing repeated
    assert_same_weights(weights(chain), weights(out))
    # metrics continue as one run: one row per rollout
    steps = [json.loads(line)["step"] for line in (chain / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(NUM_ROLLOUT + 1))


def test_truncated_checkpoint_falls_back_to_the_previous_one(straight, tmp_path):
    out, _, _ = straight
    ckpts = out / "checkpoints"
    newest, rollout_id = find_latest(ckpts)
    shard = max((newest / "train").glob("*.distcp"), key=lambda p: p.stat().st_size)
    broken = tmp_path / "ckpts"
    shutil.copytree(ckpts, broken)
    victim = broken / newest.name / "train" / shard.name
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = find_latest(broken)
    assert found is not None and found[1] < rollout_id
    assert any(newest.name in str(w.message) and shard.name in str(w.message) for w in caught)
    # export picks the previous complete checkpoint too, and it loads as an HF model
    exported = export_checkpoint(broken, tmp_path / "hf")
    assert AutoModelForCausalLM.from_pretrained(exported) is not None


def test_export_equals_final_weights(straight, tmp_path):
    out, _, _ = straight
    exported = export_checkpoint(out / "checkpoints", tmp_path / "hf")
    assert_same_weights(load_file(str(exported / "model.safetensors")), weights(out))


def test_two_actor_run_resumes_with_one(tmp_path, tiny_model_dir, addition_data):
    two = write_config(tmp_path, tiny_model_dir, addition_data, "run", num_train_actors=2)
    raw = yaml.safe_load(two.read_text())
    raw["rollout"]["num_rollout"] = 2
    two.write_text(yaml.safe_dump(raw))
    tether_train(two)
    raw["rollout"]["num_rollout"] = 4
    raw["cluster"]["num_train_actors"] = 1
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump(raw))
    tether_train(one, load=tmp_path / "run" / "checkpoints")
    assert [r["rollout_id"] for r in trained(tmp_path / "run")] == [0, 1, 2, 3]
    assert find_latest(tmp_path / "run" / "checkpoints")[1] == 3


def test_resume_refuses_a_breaking_config_change(straight, tmp_path):
    out, _, config = straight
    raw = yaml.safe_load(config.read_text())
    raw["rollout"]["n_samples_per_prompt"] = 2
    raw["train"]["global_batch_size"] = 4
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "tether.cli", "train", "--config", str(changed),
                           "--load", str(out / "checkpoints")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "rollout.n_samples_per_prompt: 4 in the checkpoint, 2 now" in proc.stderr
    assert "train.global_batch_size" in proc.stderr


def test_partial_rollout_buffer_survives_a_kill(tiny_model_dir, addition_data, tmp_path):
    """6 groups start per rollout and 4 are kept: the 2 left over wait in the partial-rollout buffer for
    the next rollout. The buffer is in every checkpoint, so a run killed and resumed trains on the
    same groups in the same order as an uninterrupted one, to the same weights."""
    partial = {"partial_rollout": True, "over_sampling_groups": 6}
    straight_cfg = write_config(tmp_path, tiny_model_dir, addition_data, "partial", rollout=partial)
    tether_train(straight_cfg)
    out = tmp_path / "partial"
    buffer = json.loads((find_latest(out / "checkpoints")[0] / "data_source.json").read_text())["buffer"]
    assert len(buffer["groups"]) == 2 and all(len(g) == 4 for g in buffer["groups"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["rollout/groups_continued"] for r in rows][:2] == [0, 2]

    config = write_config(tmp_path, tiny_model_dir, addition_data, "partial_chain", rollout=partial)
    chain, ckpts = tmp_path / "partial_chain", tmp_path / "partial_chain" / "checkpoints"
    for point in ("committed:1", "generate:2"):
        assert tether_train(config, crash_at=point, load=ckpts) == -9
    tether_train(config, load=ckpts)
    assert trained(chain) == trained(out)
    assert_same_weights(weights(chain), weights(out))


def test_one_step_off_overlaps_and_resumes_exactly(tiny_model_dir, addition_data, tmp_path):
    """rollout.schedule.mode one_step_off on 1 trainer + 1 engine: rollouts 1 and 5 generate during the train
    steps before them (the pipeline drains before the checkpoints after 1, 2, 3 and 5). Killed while a
    rollout is in flight and while one trains, and resumed, it trains on the same samples to the same
    weights as its uninterrupted run."""
    overlap = {"schedule": {"mode": "one_step_off"}}
    straight_cfg = write_config(tmp_path, tiny_model_dir, addition_data, "async", rollout=overlap, colocate=False)
    tether_train(straight_cfg)
    out = tmp_path / "async"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["async/staleness"] for r in rows] == [0, 1, 0, 0, 0, 1]
    assert all("timing/generate_wait_s" in rows[k] for k in (0, 4))
    # Rollout 1 was sampled under version 0 (pushed before rollout 0), while version 1 was being trained.
    versions = [json.loads(line)["weight_versions"] for line in (out / "rollouts" / "rollout_000001.jsonl")
                .read_text().splitlines()]
    assert {tuple(v) for v in versions} == {(0,)}

    config = write_config(tmp_path, tiny_model_dir, addition_data, "async_chain", rollout=overlap, colocate=False)
    chain, ckpts = tmp_path / "async_chain", tmp_path / "async_chain" / "checkpoints"
    for point in ("generate:5", "train:4"):  # rollout 5 in flight during train(4); then train(4) itself
        assert tether_train(config, crash_at=point, load=ckpts) == -9
    tether_train(config, load=ckpts)
    assert trained(chain) == trained(out)
    assert_same_weights(weights(chain), weights(out))


def stream_rows(out: Path) -> list[dict]:
    """Every trained sample's dump row (epoch and draw included), rollouts 0..NUM_ROLLOUT-1."""
    return [json.loads(line) for k in range(NUM_ROLLOUT)
            for line in (out / "rollouts" / f"rollout_{k:06d}.jsonl").read_text().splitlines()]


def assert_prompt_accounting(out: Path) -> None:
    """Against the last checkpoint's stream state: every prompt drawn so far was trained once (per
    epoch) or is still waiting in the stream (ready, or to generate), and nothing twice."""
    state = json.loads((find_latest(out / "checkpoints")[0] / "data_source.json").read_text())["stream"]
    trained = Counter((r["epoch"], r["prompt_index"]) for r in stream_rows(out) if r["sample_index"] == 0)
    waiting = Counter((f["epoch"], f["samples"][0]["prompt_index"]) for f in state["ready"] + state["pending"])
    assert max((trained + waiting).values()) == 1, [key for key, n in (trained + waiting).items() if n > 1]
    epoch, offset = state["position"]
    order = DataSource(list(range(12)), prompts_per_rollout=4, n_samples_per_prompt=1, shuffle=True, seed=0)
    drawn = {(e, int(i)) for e in range(epoch) for i in order.epoch_order(e)}
    drawn |= {(epoch, int(i)) for i in order.epoch_order(epoch)[:offset]}
    assert set(trained) | set(waiting) == drawn


def test_fully_async_bounds_staleness_and_a_killed_run_trains_every_prompt_once(tiny_model_dir, addition_data,
                                                                                tmp_path):
    """rollout.schedule.mode fully_async, max_staleness 2, on 1 trainer + 1 engine: every trained token is
    at most 2 versions old; killed while a take waits, while one trains and while a checkpoint is half
    written, and resumed, the run still trains on every prompt it drew once, and none twice."""
    stream = {"schedule": {"mode": "fully_async", "max_staleness": 2}, "max_response_len": 8}
    straight_cfg = write_config(tmp_path, tiny_model_dir, addition_data, "stream", rollout=stream, colocate=False,
                                deterministic=False)
    tether_train(straight_cfg)
    out = tmp_path / "stream"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == NUM_ROLLOUT
    assert all(r["async/staleness_max"] <= 2 for r in rows)
    assert max(r["async/staleness_max"] for r in rows) >= 1  # generation did run across pushes
    assert all(abs(sum(v for k, v in r.items() if k.startswith("async/staleness_tokens/")) - 1) < 1e-9 for r in rows)
    assert all(0 <= r["perf/rollout_idle_frac"] <= 1 and r["perf/samples_per_s"] > 0 for r in rows)
    assert_prompt_accounting(out)

    config = write_config(tmp_path, tiny_model_dir, addition_data, "stream_chain", rollout=stream, colocate=False,
                          deterministic=False)
    chain, ckpts = tmp_path / "stream_chain", tmp_path / "stream_chain" / "checkpoints"
    for point in ("generate:3", "train:4", "save:5"):
        assert tether_train(config, crash_at=point, load=ckpts) == -9
    tether_train(config, load=ckpts)
    assert_prompt_accounting(chain)
    assert len(trained(chain)) == NUM_ROLLOUT


def test_a_killed_trainer_is_auto_resumed_to_the_same_weights(straight, tiny_model_dir, addition_data):
    """checkpoint.auto_resume: a train actor SIGKILLed after the first checkpoint; the run restarts
    itself from that checkpoint, in the same process, and ends exactly as the undisturbed run."""
    import signal
    import time

    import psutil

    out, tmp, _ = straight
    config = write_config(tmp, tiny_model_dir, addition_data, "auto")
    raw = yaml.safe_load(config.read_text())
    raw["checkpoint"]["auto_resume"] = 1
    config.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "tether.cli", "train", "--config", str(config)], cwd=ROOT, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while find_latest(tmp / "auto" / "checkpoints") is None:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.05)
        actors = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if p.cmdline() and p.cmdline()[0].startswith("ray::TrainActor")]
        assert actors, "no train actor process found"
        os.kill(actors[0].pid, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-6000:]
    assert "trainer rank 0 died during trainer." in stdout and "auto-resume 1/1: restarting from" in stdout
    assert trained(tmp / "auto") == trained(out)  # nothing skipped, nothing repeated
    assert_same_weights(weights(tmp / "auto"), weights(out))
    steps = [json.loads(line)["step"] for line in (tmp / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(NUM_ROLLOUT + 1))


def test_sigterm_stops_a_run_cleanly_with_the_resume_command(tiny_model_dir, addition_data, tmp_path):
    import signal
    import time

    config = write_config(tmp_path, tiny_model_dir, addition_data, "stopped", rollout={"num_rollout": 500})
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "tether.cli", "train", "--config", str(config)], cwd=ROOT, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpts = tmp_path / "stopped" / "checkpoints"
    deadline = time.monotonic() + 300
    while find_latest(ckpts) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "tether: stopped by SIGTERM; the latest complete checkpoint is" in err
    assert f"to resume:  tether train --config {config} --load {ckpts}" in err
    assert "SIGTERM received" not in err  # Ray's native stack dump
