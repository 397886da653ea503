"""Driver-side handle to the rollout manager actor and the engine actors it drives."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import ray

from tether.cluster import Placement, actor_resources, dead_actors, key_env, torch_threads, wait
from tether.config import TetherConfig
from tether.engine.backends import engine_spec, startup_timeout_s
from tether.errors import EngineDiedError
from tether.faults import crash_point
from tether.rollout.manager import MANAGER_SECONDS, RolloutManager


def create_engines(cfg: TetherConfig, placement: Placement) -> list[Any]:
    """The engine actors of rollout.engine's backend, created and not waited for: they load their
    models while the trainer and the rollout manager start (RolloutHandle waits for them). None for
    rollout.external_engines: those servers run already."""
    c = cfg.cluster
    if cfg.rollout.external_engines:
        return []
    share = 2 if placement.colocate else 1
    busy = c.num_engines if placement.colocate else c.num_train_actors + c.num_engines
    device = "cuda" if c.gpus_per_bundle > 0 else "cpu"
    cls, kwargs = engine_spec(cfg, device, torch_threads(c, busy))
    actor = ray.remote(cls)
    return [actor.options(scheduling_strategy=placement.strategy(bundle), **actor_resources(c, share),
                          **key_env(c)).remote(**kwargs)
            for bundle in placement.engine_bundles]


class RolloutHandle:
    def __init__(self, cfg: TetherConfig, engines: list[Any]):
        """Starts the rollout manager (which loads the data while the engines load their models),
        waits for both and connects them. ``ready_s``: seconds until each was ready."""
        start = time.perf_counter()
        self.timeout_s = cfg.cluster.call_timeout_s
        self.engines = engines
        # The manager only coordinates; a small CPU share outside the placement group is enough.
        self.actor = ray.remote(RolloutManager).options(num_cpus=0.1, **key_env(cfg.cluster)).remote(
            cfg.model_dump(mode="json"))
        self.info = self._get(self.actor.data_info.remote(), "rollout manager start (loading data)")
        self.ready_s = {"rollout manager": time.perf_counter() - start}
        health = wait([e.health.remote() for e in engines], startup_timeout_s(cfg),
                      f"{len(engines)} {cfg.rollout.engine} engine(s) to load {cfg.model.path}")
        self.ready_s["engines"] = time.perf_counter() - start
        self.engine_pids = [h["pid"] for h in health]
        urls = [h["url"] for h in health] + list(cfg.rollout.external_engines)
        self._get(self.actor.connect_engines.remote(urls), "connect_engines")

    def _get(self, ref: Any, what: str, extra_s: float = 0.0) -> Any:
        return wait(ref, self.timeout_s + extra_s, f"rollout.{what}")

    def _get_from_engines(self, ref: Any, what: str, extra_s: float = 0.0) -> Any:
        """``_get`` for work that goes to the engines: when it fails and an engine has died, say that
        (with Ray's exit reason and the tail of its log) rather than the connection error it caused."""
        try:
            return self._get(ref, what, extra_s)
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
        start = time.perf_counter()
        batch_ref, metrics = self.submit_generate(rollout_id).result()
        metrics["timing/rollout_call_overhead_s"] = time.perf_counter() - start - metrics[MANAGER_SECONDS]
        return batch_ref, {k: v for k, v in metrics.items() if k != MANAGER_SECONDS}

    def submit_generate(self, rollout_id: int) -> PendingGenerate:
        """Start rollout_id on the rollout manager and return at once (one-step-off training)."""
        batch_ref, metrics_ref = self.actor.generate.options(num_returns=2).remote(rollout_id)
        crash_point("generate", rollout_id)
        return PendingGenerate(self, rollout_id, batch_ref, metrics_ref)

    # Fully asynchronous rollout (tether/rollout/stream.py).
    def start_stream(self, version: int, next_take: int) -> None:
        self._get(self.actor.stream_start.remote(version, next_take), "start the rollout stream")

    def take(self, rollout_id: int) -> tuple[ray.ObjectRef, dict[str, float]]:
        """(reference to the TrainBatch, metrics) of the stream's next groups; the stream's own wait is
        bounded by the call timeout and says what it waited for, so this one allows a little more."""
        start = time.perf_counter()
        batch_ref, metrics_ref = self.actor.stream_take.options(num_returns=2).remote(rollout_id)
        crash_point("generate", rollout_id)
        metrics = self._get_from_engines(metrics_ref, f"take(rollout {rollout_id})", extra_s=30.0)
        metrics["timing/rollout_call_overhead_s"] = time.perf_counter() - start - metrics.pop(MANAGER_SECONDS)
        return batch_ref, metrics

    def pause(self) -> None:
        self._get_from_engines(self.actor.stream_pause.remote(), "pause the rollout stream")

    def resume(self, version: int) -> None:
        self._get_from_engines(self.actor.stream_resume.remote(version), f"resume the rollout stream at version {version}")

    def eval(self, rollout_id: int) -> dict[str, float]:
        return self._get_from_engines(self.actor.eval.remote(rollout_id), f"eval(rollout {rollout_id})")

    def keep_all_dumps(self) -> None:
        """`tether rollout`: every rollout's file stays (debug.keep_rollout_dumps is for training runs)."""
        self._get(self.actor.keep_all_dumps.remote(), "keep_all_dumps")

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
        # Engines stop their servers first (a vLLM or SGLang server and the processes it started), then go.
        try:
            wait([e.shutdown.remote() for e in self.engines], 60, "engines stopping their servers")
        except Exception as err:  # a dead or stuck engine: killing its actor below is all that is left
            print(f"[tether] engine shutdown: {str(err).splitlines()[0]}", file=sys.stderr)
        for engine in self.engines:
            ray.kill(engine)


@dataclass
class PendingGenerate:
    """A rollout started on the rollout manager; ``result()`` waits for it (with the call timeout)."""

    handle: RolloutHandle
    rollout_id: int
    batch_ref: ray.ObjectRef
    metrics_ref: ray.ObjectRef

    def result(self) -> tuple[ray.ObjectRef, dict[str, float]]:
        return self.batch_ref, self.handle._get_from_engines(self.metrics_ref, f"generate(rollout {self.rollout_id})")
