"""Driver-side handle to the N train actors: creates them in the placement and calls them together."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray

from tether.cluster import ActorGroup, Placement, actor_resources, key_env, torch_threads, wait
from tether.run.faults import crash_point
from tether.config import TetherConfig
from tether.trainer.actor import TrainActor


class TrainerGroup:
    def __init__(self, cfg: TetherConfig, placement: Placement):
        c = cfg.cluster
        self.cfg = cfg
        share = 2 if placement.colocate else 1
        # Colocated parts take turns, so each may use all cores; disaggregated ones split them.
        busy = c.num_train_actors if placement.colocate else c.num_train_actors + c.num_engines
        threads = torch_threads(c, busy)
        cls = ray.remote(TrainActor)
        cfg_dict = cfg.model_dump(mode="json")
        actors = [
            cls.options(scheduling_strategy=placement.strategy(bundle), **actor_resources(c, share),
                        **key_env(c), name=None).remote(cfg_dict, rank, c.num_train_actors, threads)
            for rank, bundle in enumerate(placement.train_bundles)
        ]
        # Created, not waited for: the actors import torch and start while engines and the rollout
        # manager do the same; ``start`` (or ``init``) waits.
        self.group = ActorGroup(actors, "trainer", c.call_timeout_s)
        self.started = False

    def start(self) -> None:
        """Wait for the actors and join them in one torch.distributed group."""
        if self.started:
            return
        master_addr, master_port = self.group.call("address", what="rank addresses")[0]
        self.group.call("setup_distributed", master_addr, master_port, what="torch.distributed init")
        self.started = True

    def init(self, total_steps: int, with_ref: bool, load_dir: str | None) -> None:
        self.start()
        self.group.call("init", total_steps, with_ref, load_dir, what=f"model init (load={load_dir})")

    def train(self, step_id: int, batch_ref: Any, policy_loss: str | None = None,
              global_batch_size: int | None = None) -> dict[str, float]:
        # batch_ref is resolved by Ray inside each actor: the batch never passes through the driver.
        start = time.perf_counter()
        refs = self.group.submit("train", step_id, batch_ref, policy_loss, global_batch_size)
        crash_point("train", step_id)
        metrics = wait(refs, self.group.timeout_s, f"trainer.train(step {step_id}) on {len(self.group)} rank(s)")[0]
        # What the actor did not spend training: fetching the batch from the object store, the Ray call.
        metrics["timing/train_call_overhead_s"] = time.perf_counter() - start - metrics["timing/train_s"]
        return metrics

    def score(self, batch: Any) -> list[list[float]]:
        return self.group.call("score", batch, what="score")[0]

    def connect_engines(self, engines: list[Any], external_urls: Sequence[str] = ()) -> None:
        """Engine actors (their servers' URLs are asked) and servers already running elsewhere."""
        urls = wait([e.url.remote() for e in engines], self.group.timeout_s, "engine server addresses")
        self.group.call("connect_engines", engines, urls + list(external_urls), what="connect engines")

    def replace_engine(self, index: int, engine: Any, url: str) -> None:
        """Give a replacement engine the current weights; later pushes include it."""
        self.group.call("replace_engine", index, engine, url, what=f"weights for replacement engine {index}")

    def push_weights(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        refs = self.group.submit("push_weights", version)
        crash_point("push", version - 1)  # the push that follows rollout version - 1
        metrics = wait(refs, self.group.timeout_s, f"trainer.push_weights(version {version})")[0]
        metrics["timing/weight_sync_call_overhead_s"] = time.perf_counter() - start - metrics.get("weight_sync/seconds", 0.0)
        return metrics

    def save(self, staging_dir: str) -> None:
        self.group.call("save", staging_dir, what=f"checkpoint save to {staging_dir}")

    def save_hf(self, out_dir: str) -> None:
        self.group.call("save_hf", out_dir, what=f"HF export to {out_dir}")

    def offload(self) -> None:
        self.group.call("offload", what="offload")

    def onload(self) -> None:
        self.group.call("onload", what="onload")

    def shutdown(self) -> None:
        try:
            self.group.call("shutdown", what="shutdown", timeout_s=30)
        finally:
            self.group.kill()
