"""A tiny run on a simulated multi-node Ray cluster (several raylets on this machine), run as its own
process by test_multinode.py: a test session's Ray cannot be swapped for a cluster in-process.

Every node has one CPU and every bundle asks for one, so the two trainer ranks, the two engines and
the rollout manager each land on a node of their own, and weights cross object stores (or the
broadcast group) between nodes. Prints one JSON line: per weight-sync transport, where each actor
ran and the run's summary.

usage: python multinode_run.py <tiny model dir> <train.jsonl> <output dir>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from tether.cluster import loopback_only
from tether.config import config_from_dict
from tether.train import train


def actors() -> dict[str, tuple[str, str]]:
    """Actor id -> (class, node id) of every actor of the job, alive or finished."""
    from ray._private import state  # the GCS actor table: no dashboard needed

    return {aid: (info["ActorClassName"], info["Address"]["NodeID"]) for aid, info in state.actors().items()}


def main(model_dir: str, data: str, out: str) -> None:
    loopback_only()  # every raylet of the simulated cluster on 127.0.0.1, as a local run's
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(4):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    results = {}
    try:
        for transport in ("object_store", "distributed"):
            before = actors()
            cfg = config_from_dict({
                "output_dir": str(Path(out) / transport), "seed": 0,
                "cluster": {"num_train_actors": 2, "num_engines": 2, "colocate": False, "cpus_per_bundle": 1,
                            "weight_sync": transport, "call_timeout_s": 120, "collective_timeout_s": 60,
                            "torch_threads": 1},
                "model": {"path": model_dir}, "data": {"path": data},
                "rollout": {"num_rollout": 2, "prompts_per_rollout": 4, "n_samples_per_prompt": 4,
                            "max_response_len": 4, "reward": "exact_match"},
                "train": {"lr": 1e-3, "micro_batch_size": 4, "global_batch_size": 8},
                "tracking": {"tensorboard": False}})
            train(cfg)
            placed: dict[str, list[str]] = {}
            for aid, (cls, node) in actors().items():
                if aid not in before:  # this run's
                    placed.setdefault(cls, []).append(node)
            rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
            results[transport] = {"nodes": placed, "num_nodes": len(ray.nodes()), "metrics": rows[-1]}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
