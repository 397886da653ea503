"""Driver-side handle to the rollout manager actor and the engine actors it drives.

While it waits for a rollout or an eval, the handle asks the manager (every
cluster.engine_health_interval_s) which engines were lost, and replaces each: the lost actor is
killed, a new one starts on its placement-group bundle, gets the trainer's current weights (or
loads model.path when there is no trainer), and joins the router, which has meanwhile sent the lost
engine's requests to the others (or held them, when it was the only one).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray

from tether.cluster import Placement, actor_resources, dead_actors, key_env, log_tail, torch_threads, wait
from tether.config import TetherConfig
from tether.engine.backends import engine_spec, placed_engines, served_config, served_engines, startup_timeout_s
from tether.errors import EngineDiedError, RemoteTimeout
from tether.run.faults import ENGINE_FAULT, ENGINE_UPDATE_FAULT, INJECT_FAULTS, crash_point
from tether.scheduling import wait_started
from tether.rollout.manager import FAULTS, MANAGER_SECONDS, RolloutManager

MANAGER_CPUS = 0.1
"""The rollout manager only coordinates: a small CPU share outside the placement group."""

WeightLoader = Callable[[int, Any, str], None]
"""(engine index, new engine actor, its URL): give a replacement engine the current weights."""


def create_engines(cfg: TetherConfig, placement: Placement) -> list[Any]:
    """The engine actors of engine.backend, created and not waited for: they load their models while
    the trainer and the rollout manager start (RolloutHandle waits for them). None for engine.backend:
    external: those servers run already."""
    if not placed_engines(cfg):
        return []
    return [create_engine(cfg, placement, k) for k in range(len(placement.engine_bundles))]


def create_engine(cfg: TetherConfig, placement: Placement, index: int) -> Any:
    """Engine ``index``'s actor on its bundle (at the start, or replacing a lost one)."""
    return _engine_actor(cfg, placement, placement.engine_bundles[index], share=2 if placement.colocate else 1)


def _engine_actor(cfg: TetherConfig, placement: Placement, bundle: int, share: int) -> Any:
    """An engine actor of ``cfg``'s model and backend on ``bundle``, which it shares with ``share`` actors;
    its torch threads are the cores over every engine and trainer that computes at once."""
    c = cfg.cluster
    busy = (c.num_engines if placement.colocate else c.num_train_actors + c.num_engines) + served_engines(cfg)
    device = "cuda" if c.gpus_per_bundle > 0 else "cpu"
    cls, kwargs = engine_spec(cfg, device, torch_threads(c, busy))
    return ray.remote(cls).options(scheduling_strategy=placement.strategy(bundle), **actor_resources(c, share),
                                   **actor_env(c)).remote(**kwargs)


@dataclass
class ServedEngine:
    """One engine of a served model: which model, its bundle, its actor, and once up its URL and pid."""

    name: str
    bundle: int
    actor: Any
    url: str = ""
    pid: int = 0


def create_served(cfg: TetherConfig, placement: Placement) -> list[ServedEngine]:
    """The served models' engine actors (cfg.served_models with a path), one bundle each, not waited for."""
    bundles = iter(placement.served_bundles)
    return [ServedEngine(name, bundle, create_served_engine(cfg, placement, name, bundle))
            for name, m in cfg.served_models.items() for bundle in [next(bundles) for _ in range(m.placed)]]


def create_served_engine(cfg: TetherConfig, placement: Placement, name: str, bundle: int) -> Any:
    """An engine of served model ``name`` on its own bundle (never shared)."""
    return _engine_actor(served_config(cfg, name), placement, bundle, share=1)


def actor_env(c, faults: tuple[str, ...] = (ENGINE_FAULT, ENGINE_UPDATE_FAULT)) -> dict:
    """key_env, and the faults a test asked for (``faults``: the variables passed on; tether/run/faults.py)."""
    options = key_env(c)
    for name in faults:
        if name in os.environ:
            env = options.setdefault("runtime_env", {}).setdefault("env_vars", {})
            env[name] = os.environ[name]
    return options


class RolloutHandle:
    def __init__(self, cfg: TetherConfig, engines: list[Any], placement: Placement | None = None):
        """Starts the rollout manager (which loads the data while the engines load their models),
        waits for both and connects them. ``ready_s``: seconds until each was ready. With the
        ``placement`` the engines were created on, lost engines are replaced."""
        start = time.perf_counter()
        self.cfg, self.placement = cfg, placement
        self.timeout_s = cfg.cluster.call_timeout_s
        self.engines = engines
        self.restarts = 0
        self.load_weights: WeightLoader | None = None  # set once a trainer holds the weights
        # Served models load beside the policy's engines and the manager (their bundles come last).
        self.served = create_served(cfg, placement) if placement is not None else []
        # concurrency_groups is an actor option Ray's typed overloads of ray.remote leave out.
        manager = ray.remote(concurrency_groups={FAULTS: 1})(RolloutManager)  # type: ignore[call-overload]
        self.actor = manager.options(num_cpus=MANAGER_CPUS, **actor_env(cfg.cluster, (INJECT_FAULTS,))).remote(
            cfg.model_dump(mode="json"))
        try:
            self.info = wait_started(self.actor.data_info.remote(), self.actor, {"CPU": MANAGER_CPUS}, self.timeout_s,
                                     "rollout manager start (loading data)")
        except BaseException:
            ray.kill(self.actor)  # not left waiting for room, to start once the caller has given up
            raise
        self.ready_s = {"rollout manager": time.perf_counter() - start}
        health = wait([e.health.remote() for e in engines], startup_timeout_s(cfg),
                      f"{len(engines)} {cfg.engine.backend} engine(s) to load {cfg.model.path}")
        self.ready_s["engines"] = time.perf_counter() - start
        self.engine_pids = [h["pid"] for h in health]
        self.urls = [h["url"] for h in health]
        self.replaces = placement is not None and cfg.cluster.max_engine_restarts > 0
        self._start_served()
        self._get(self.actor.connect_engines.remote(self.urls + cfg.external_engines, self.replaces,
                                                    self.served_urls()), "connect_engines")

    def _start_served(self) -> None:
        if not self.served:
            return
        start = time.perf_counter()
        names = sorted({e.name for e in self.served})
        health = wait([e.actor.health.remote() for e in self.served], startup_timeout_s(self.cfg),
                      f"{len(self.served)} engine(s) of the served model(s) {', '.join(names)} to load")
        for engine, h in zip(self.served, health):
            engine.url, engine.pid = h["url"], h["pid"]
        self.ready_s["served models"] = self.ready_s["engines"] + time.perf_counter() - start

    def served_urls(self) -> dict[str, list[str]]:
        """Each served model's engines: the ones started here, then its urls: (servers already running)."""
        return {name: [e.url for e in self.served if e.name == name] + list(m.urls)
                for name, m in self.cfg.served_models.items()}

    def _get(self, ref: Any, what: str, extra_s: float = 0.0) -> Any:
        return wait(ref, self.timeout_s + extra_s, f"rollout.{what}")

    def _get_from_engines(self, ref: Any, what: str, extra_s: float = 0.0) -> Any:
        """``_get`` for work that goes to the engines, replacing lost engines while it waits (their
        time does not count against the call's). When it fails and an engine has died, say that (with
        Ray's exit reason and the tail of its log) rather than the connection error it caused."""
        try:
            deadline = time.monotonic() + self.timeout_s + extra_s
            while not ray.wait([ref], timeout=self.cfg.cluster.engine_health_interval_s)[0]:
                if self.replaces:
                    deadline += self.replace_lost()
                if time.monotonic() > deadline:
                    raise RemoteTimeout(f"timed out after {self.timeout_s + extra_s:.0f}s waiting for rollout.{what}")
            if self.replaces:  # lost near the end: replaced before the weights are pushed to it
                self.replace_lost()
            return ray.get(ref)
        except Exception as err:
            engines = {f"engine {i}": (e, pid) for i, (e, pid) in enumerate(zip(self.engines, self.engine_pids))}
            engines.update({f"engine of served model {e.name!r} ({e.url})": (e.actor, e.pid) for e in self.served})
            dead = dead_actors(engines)
            if dead:
                raise EngineDiedError(f"rollout.{what} failed because an engine process died:\n" + "\n".join(dead)
                                      + f"\n(the error it caused: {str(err).strip().splitlines()[-1]})") from err
            raise

    def replace_lost(self) -> float:
        """Replace every engine the manager reports lost; returns the seconds it took."""
        start = time.monotonic()
        lost = wait(self.actor.lost_engines.remote(), 30, "rollout.lost_engines")
        served = {e.url: e for e in self.served}
        for url, reason in lost.items():
            if url in self.urls:  # an external engine is not ours to restart: it stays out
                self._replace(self.urls.index(url), reason)
            elif url in served:
                self._replace_served(served[url], reason)
        return time.monotonic() - start

    def _count_restart(self, name: str, reason: str, pid: int) -> None:
        c = self.cfg.cluster
        if self.restarts >= c.max_engine_restarts:
            raise EngineDiedError(f"{name} was lost ({reason}), and the run already replaced "
                                  f"cluster.max_engine_restarts={c.max_engine_restarts} engine(s)\n" + log_tail(pid))
        self.restarts += 1
        print(f"[tether] {name} lost: {reason}; starting a replacement on its bundle "
              f"(engine restart {self.restarts}/{c.max_engine_restarts})", file=sys.stderr, flush=True)

    def _replace_served(self, engine: ServedEngine, reason: str) -> None:
        """A served model's engine is replaced by a new one loading the same model (no weights to push)."""
        name = f"engine of served model {engine.name!r} ({engine.url}, pid {engine.pid})"
        self._count_restart(name, reason, engine.pid)
        start = time.perf_counter()
        ray.kill(engine.actor, no_restart=True)
        assert self.placement is not None  # served engines exist only with a placement
        engine.actor = create_served_engine(self.cfg, self.placement, engine.name, engine.bundle)
        health = wait(engine.actor.health.remote(), startup_timeout_s(self.cfg),
                      f"replacement engine of served model {engine.name} to load "
                      f"{self.cfg.served_models[engine.name].path}")
        self._get(self.actor.replace_engine.remote(engine.url, health["url"]), "replace_engine")
        engine.url, engine.pid = health["url"], health["pid"]
        print(f"[tether] {name} replaced by {engine.url} (pid {engine.pid}) in {time.perf_counter() - start:.1f}s",
              file=sys.stderr, flush=True)

    def replace_engines(self, indices: list[int], reason: str) -> float:
        """Replace engines lost outside a rollout (during a weight push); returns the seconds it took."""
        start = time.monotonic()
        for index in indices:
            self._replace(index, f"it died during the weight push ({reason})")
        return time.monotonic() - start

    def _replace(self, index: int, reason: str) -> None:
        name = f"engine {index} ({self.urls[index]}, pid {self.engine_pids[index]})"
        self._count_restart(name, reason, self.engine_pids[index])
        start = time.perf_counter()
        ray.kill(self.engines[index], no_restart=True)  # a frozen process too: Ray kills it
        assert self.placement is not None  # engines are replaced only with a placement (self.replaces)
        engine = create_engine(self.cfg, self.placement, index)
        health = wait(engine.health.remote(), startup_timeout_s(self.cfg),
                      f"replacement engine {index} to load {self.cfg.model.path}")
        if self.load_weights is not None:
            self.load_weights(index, engine, health["url"])
        self._get(self.actor.replace_engine.remote(self.urls[index], health["url"]), "replace_engine")
        self.engines[index], self.engine_pids[index], self.urls[index] = engine, health["pid"], health["url"]
        print(f"[tether] engine {index} replaced by {health['url']} (pid {health['pid']}) in "
              f"{time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)

    def num_rollout_per_epoch(self) -> int:
        return self._get(self.actor.num_rollout_per_epoch.remote(), "num_rollout_per_epoch")

    def generate(self, rollout_id: int) -> tuple[ray.ObjectRef, dict[str, float]]:
        """(reference to the TrainBatch, metrics). Only the metrics are fetched to the driver."""
        start = time.perf_counter()
        batch_ref, metrics = self.submit_generate(rollout_id).result()
        metrics["timing/rollout_call_overhead_s"] = time.perf_counter() - start - metrics[MANAGER_SECONDS]
        metrics["faults/engine_restarts"] = float(self.restarts)
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
        metrics["faults/engine_restarts"] = float(self.restarts)
        return batch_ref, metrics

    def pause(self) -> None:
        self._get_from_engines(self.actor.stream_pause.remote(), "pause the rollout stream")

    def resume(self, version: int) -> None:
        self._get_from_engines(self.actor.stream_resume.remote(version), f"resume the rollout stream at version {version}")

    def eval(self, rollout_id: int) -> dict[str, float]:
        return self._get_from_engines(self.actor.eval.remote(rollout_id), f"eval(rollout {rollout_id})")

    def prepare_data(self) -> dict:
        """What data.difficulty measures before the first rollout, a chunk a call (each within the call
        timeout); the probe's metrics."""
        while True:
            out = self._get_from_engines(self.actor.prepare_data.remote(), "prepare_data (data.difficulty's probe)")
            if out.pop("done"):
                return out

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
            wait([e.shutdown.remote() for e in self.engines + [s.actor for s in self.served]], 60,
                 "engines stopping their servers")
        except Exception as err:  # a dead or stuck engine: killing its actor below is all that is left
            print(f"[tether] engine shutdown: {str(err).splitlines()[0]}", file=sys.stderr)
        for engine in self.engines + [e.actor for e in self.served]:
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
