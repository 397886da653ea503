"""Driver-side handle to the rollout manager actor and the engine actors it drives."""

from __future__ import annotations

from typing import Any

import ray

from tether.cluster import Placement, actor_resources, dead_actors, torch_threads, wait
from tether.config import TetherConfig
from tether.engine.actor import EngineActor
from tether.errors import EngineDiedError
from tether.faults import crash_point
from tether.rollout.manager import RolloutManager


def create_engines(cfg: TetherConfig, placement: Placement) -> list[Any]:
    c, r = cfg.cluster, cfg.rollout
    share = 2 if placement.colocate else 1
    busy = c.num_engines if placement.colocate else c.num_train_actors + c.num_engines
    cls = ray.remote(EngineActor)
    device = "cuda" if c.gpus_per_bundle > 0 else "cpu"
    engines = [
        cls.options(scheduling_strategy=placement.strategy(bundle), **actor_resources(c, share)).remote(
            cfg.model.path, dtype=cfg.model.dtype, max_batch=r.max_generate_batch, threads=torch_threads(c, busy),
            device=device, deterministic=cfg.deterministic, max_batch_tokens=r.max_batch_tokens,
            host=r.engine_host, seed=cfg.seed, onednn_linear=r.onednn_linear,
            prefix_cache_tokens=r.prefix_cache_tokens)
        for bundle in placement.engine_bundles
    ]
    wait([e.health.remote() for e in engines], c.call_timeout_s, f"{len(engines)} engine(s) to load {cfg.model.path}")
    return engines


class RolloutHandle:
    def __init__(self, cfg: TetherConfig, engines: list[Any]):
        self.timeout_s = cfg.cluster.call_timeout_s
        self.engines = engines
        health = wait([e.health.remote() for e in engines], self.timeout_s, "engine health")
        self.engine_pids = [h["pid"] for h in health]
        # The manager only coordinates; a small CPU share outside the placement group is enough.
        urls = wait([e.url.remote() for e in engines], self.timeout_s, "engine server addresses")
        self.actor = ray.remote(RolloutManager).options(num_cpus=0.1).remote(cfg.model_dump(mode="json"), urls)
        self.info = self._get(self.actor.data_info.remote(), "rollout manager start (loading data)")

    def _get(self, ref: Any, what: str) -> Any:
        return wait(ref, self.timeout_s, f"rollout.{what}")

    def _get_from_engines(self, ref: Any, what: str) -> Any:
        """``_get`` for work that goes to the engines: when it fails and an engine has died, say that
        (with Ray's exit reason and the tail of its log) rather than the connection error it caused."""
        try:
            return self._get(ref, what)
        except Exception as err:
            dead = dead_actors({f"engine {i}": (e, pid) for i, (e, pid) in enumerate(zip(self.engines, self.engine_pids))})
            if dead:
                raise EngineDiedError(f"rollout.{what} failed because an engine process died:\n" + "\n".join(dead)
                                      + f"\n(the error it caused: {str(err).strip().splitlines()[-1]})") from err
            raise

    def num_rollout_per_epoch(self) -> int:
        return self._get(self.actor.num_rollout_per_epoch.remote(), "num_rollout_per_epoch")

    def generate(self, rollout_id: int) -> tuple[ray.ObjectRef, dict[str, float]]:
        """(reference to the TrainBatch, metrics). Only the metrics are fetched to the driver."""
        batch_ref, metrics_ref = self.actor.generate.options(num_returns=2).remote(rollout_id)
        crash_point("generate", rollout_id)
        return batch_ref, self._get_from_engines(metrics_ref, f"generate(rollout {rollout_id})")

    def eval(self, rollout_id: int) -> dict[str, float]:
        return self._get_from_engines(self.actor.eval.remote(rollout_id), f"eval(rollout {rollout_id})")

    def save_state(self, ckpt_dir: str) -> None:
        self._get(self.actor.save_state.remote(ckpt_dir), f"save_state({ckpt_dir})")

    def load_state(self, ckpt_dir: str) -> dict:
        return self._get(self.actor.load_state.remote(ckpt_dir), f"load_state({ckpt_dir})")

    def offload(self, tags: list[str]) -> None:
        self._get(self.actor.release_memory.remote(tags), f"release engine memory {tags}")

    def onload(self, tags: list[str]) -> None:
        self._get(self.actor.resume_memory.remote(tags), f"resume engine memory {tags}")

    def shutdown(self) -> None:
        ray.kill(self.actor)
        for engine in self.engines:
            ray.kill(engine)
