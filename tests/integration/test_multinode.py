"""The same run on a simulated multi-node cluster: trainer ranks, engines and the rollout manager on
nodes of their own, weights crossing between nodes by both weight-sync transports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "multinode_run.py"


def test_a_run_spread_over_five_nodes_trains_with_both_transports(tiny_model_dir, addition_data, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own cluster, not a session's
    done = subprocess.run([sys.executable, str(SCRIPT), str(tiny_model_dir), str(addition_data["train"]),
                           str(tmp_path)], capture_output=True, text=True, timeout=480, env=env,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for transport in ("object_store", "distributed"):
        run = results[transport]
        nodes = run["nodes"]
        assert run["num_nodes"] == 5
        trainers, engines, manager = nodes["TrainActor"], nodes["EngineActor"], nodes["RolloutManager"]
        assert len(trainers) == 2 and len(engines) == 2 and len(manager) == 1
        # Five actors with one CPU each (the manager a share), on five one-CPU nodes: all apart.
        assert len(set(trainers + engines + manager)) == 5, nodes
        metrics = run["metrics"]
        assert metrics["step"] == 2 and metrics["weight_sync/megabytes"] > 0
        # The engines generate with exactly the weights the trainer scores with: they arrived whole.
        assert metrics["mismatch/logprob_abs_diff_max"] < 1e-5
