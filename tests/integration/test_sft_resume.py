"""`tether sft --load`: an SFT run killed mid-way and resumed from its checkpoint ends with the same
weights, bit for bit, as one that was never interrupted; on chat-format rows, packed micro-batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tether.run.checkpoint import find_latest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _data(path: Path) -> Path:
    rows = []
    for a in range(8):
        for b in range(2):
            rows.append({"messages": [{"role": "user", "content": f"{a}+{b}="},
                                      {"role": "assistant", "content": str(a + b)},
                                      {"role": "user", "content": "again"},
                                      {"role": "assistant", "content": str(a + b)}]} if (a + b) % 2 else
                        {"prompt": f"{a}+{b}=", "response": str(a + b)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, model_dir: Path, name: str) -> Path:
    raw = {"output_dir": str(tmp_path / name), "seed": 0, "deterministic": True,
           "cluster": {"num_train_actors": 1, "num_engines": 1, "call_timeout_s": 120, "collective_timeout_s": 60,
                       "torch_threads": 1},
           "model": {"path": str(model_dir)},
           "data": {"apply_chat_template": True},
           "sft": {"path": str(_data(tmp_path / "sft.jsonl")), "batch_size": 4, "num_epoch": 2},
           "train": {"lr": 1e-3, "max_tokens_per_micro_batch": 40},  # packed micro-batches
           "checkpoint": {"save_interval": 3},  # and every epoch's end: steps 2, 3, 5, 7 (0-based)
           "tracking": {"tensorboard": False}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _sft(config: Path, crash_at: str | None = None, load: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if crash_at:
        env["TETHER_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "tether.cli", "sft", "--config", str(config)] + (["--load", str(load)] if load else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, start_new_session=True, timeout=600, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == (-9 if crash_at else 0), proc.stdout[-5000:]
    return proc.stdout


def test_killed_sft_resumes_to_the_same_weights(tmp_path, tiny_model_dir):
    whole = _config(tmp_path, tiny_model_dir, "whole")
    _sft(whole)
    want = load_file(str(tmp_path / "whole" / "hf" / "model.safetensors"))

    broken = _config(tmp_path, tiny_model_dir, "broken")
    _sft(broken, crash_at="train:5")  # killed while step 5 trains; the last checkpoint is step 3's
    ckpts = tmp_path / "broken" / "checkpoints"
    assert find_latest(ckpts)[1] == 3
    out = _sft(broken, load=ckpts)
    assert "resuming from" in out and "continuing at 4" in out
    got = load_file(str(tmp_path / "broken" / "hf" / "model.safetensors"))
    assert set(got) == set(want) and all(got[k].equal(want[k]) for k in want)
    steps = [json.loads(line)["step"] for line in (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert steps == list(range(1, 9))  # each of the 8 steps logged once, across the two processes
    assert find_latest(ckpts)[1] == 7
