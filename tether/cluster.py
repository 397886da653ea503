"""Ray: starting or joining a cluster, placement of trainer and engines, and timed remote calls.

Layouts
- colocated: one bundle per trainer rank; engines are placed on the same bundles (engine i on
  bundle i mod N). Trainer and engines take turns on the same devices.
- disaggregated: trainer bundles first, then one bundle per engine.

Every remote result is fetched through ``wait`` with a timeout whose error names what was waited on:
a run never hangs silently.
"""

from __future__ import annotations

import os
import signal
import threading
import re
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tether.config import ClusterConfig
from tether.errors import RemoteTimeout, TrainerDiedError
from tether.http.guard import API_KEY_ENV
from tether.scheduling import wait_placement


def wait(refs: Any, timeout_s: float, what: str) -> Any:
    """ray.get with a deadline. ``what`` names the call, e.g. 'trainer.train(rollout 3) on 2 ranks'."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RemoteTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}") from None


class Stopped(KeyboardInterrupt):
    """SIGTERM, turned into what Ctrl-C raises: the run unwinds (actors stop, the tracker closes)."""


def _stop(signum, frame) -> None:
    raise Stopped("SIGTERM")


def start_ray(cfg: ClusterConfig, num_bundles: int) -> None:
    """Join RAY_ADDRESS / cfg.ray_address when given, otherwise start a local Ray. Afterwards SIGTERM
    stops the run as Ctrl-C does (Ray's own handler would print a native stack dump and exit)."""
    if ray.is_initialized():
        return
    try:
        _init_ray(cfg, num_bundles)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _stop)


def _init_ray(cfg: ClusterConfig, num_bundles: int) -> None:
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, log_to_driver=True)
        return
    # A local cluster's workers inherit this process's environment. Without a runtime_env of the
    # job's own, the workers Ray starts ahead of time can become actors (no fresh process each).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    loopback_only()
    # Actors pin torch threads themselves; logical CPUs only need to cover the layout.
    need = int(num_bundles * cfg.cpus_per_bundle) + 2  # + rollout manager and slack
    ray.init(
        address="local",  # a new local Ray, even when a `ray start` cluster runs on this machine
        num_cpus=cfg.ray_num_cpus or max(need, 4),
        num_gpus=None if cfg.gpus_per_bundle else 0,
        include_dashboard=False,
        log_to_driver=True,
    )


def loopback_only() -> None:
    """Make a local Ray listen on loopback only (GCS, raylet, object manager, agents, workers), not on
    every interface where anyone on the network could submit jobs. Ray does so when multi-node
    clusters are off (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): its node address is then 127.0.0.1. The
    processes Ray starts read the variable; this process read it at import, so its constant is set too."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


@dataclass
class Placement:
    """Where each actor goes: (placement group, bundle index) per trainer rank and per engine."""

    group: PlacementGroup
    train_bundles: list[int]
    engine_bundles: list[int]
    colocate: bool
    served_bundles: list[int] = field(default_factory=list)
    """One bundle per engine of the served models (cfg.served_models, in order), never shared."""

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=bundle)

    def remove(self) -> None:
        remove_placement_group(self.group)


def plan_placement(cfg: ClusterConfig, engines: int | None = None, served: int = 0) -> Placement:
    """Reserve bundles for the layout and wait until Ray grants them. ``engines``: how many engines
    need bundles (default cluster.num_engines; 0 when they run elsewhere, engine.backend: external);
    ``served``: engines of served models (frozen: a bundle each, after the others)."""
    n_train, n_engine = cfg.num_train_actors, cfg.num_engines if engines is None else engines
    n_policy = max(n_train, n_engine) if cfg.colocate else n_train + n_engine
    n_bundles = n_policy + served
    bundle: dict[str, float] = {"CPU": cfg.cpus_per_bundle}
    if cfg.gpus_per_bundle:
        bundle["GPU"] = cfg.gpus_per_bundle
    start_ray(cfg, n_bundles)
    # PACK keeps a rank's bundles on as few nodes as possible, so bundle order follows node order.
    group = placement_group([dict(bundle) for _ in range(n_bundles)], strategy="PACK")
    wait_placement(group.ready(), [dict(bundle) for _ in range(n_bundles)], cfg.call_timeout_s,
                   f"placement group of {n_bundles} bundles {bundle}")
    train = list(range(n_train))
    if cfg.colocate:
        engine_bundles = [i % n_policy for i in range(n_engine)]
    else:
        engine_bundles = list(range(n_train, n_train + n_engine))
    return Placement(group=group, train_bundles=train, engine_bundles=engine_bundles, colocate=cfg.colocate,
                     served_bundles=list(range(n_policy, n_bundles)))


def actor_resources(cfg: ClusterConfig, share: int) -> dict[str, float]:
    """Resources for one actor that shares its bundle with ``share`` actors (colocated layouts)."""
    return {"num_cpus": cfg.cpus_per_bundle / share, "num_gpus": cfg.gpus_per_bundle / share}


def key_env(cfg: ClusterConfig) -> dict[str, Any]:
    """Actor options that hand cluster.api_key (or the driver's TETHER_API_KEY) to the actor's
    environment, where tether's engine clients read it (http_guard.auth_headers)."""
    key = cfg.api_key or os.environ.get(API_KEY_ENV)
    return {"runtime_env": {"env_vars": {API_KEY_ENV: key}}} if key else {}


def torch_threads(cfg: ClusterConfig, busy_actors: int) -> int:
    """Intra-op threads per actor: the machine's cores spread over actors that compute at once."""
    if cfg.torch_threads:
        return cfg.torch_threads
    return max(1, (os.cpu_count() or 1) // max(1, busy_actors))


class ActorGroup:
    """N actors of one class called together: ``group.call('train', ...)`` fans out and waits."""

    def __init__(self, actors: Sequence[Any], name: str, timeout_s: float):
        self.actors = list(actors)
        self.name = name
        self.timeout_s = timeout_s

    def __len__(self) -> int:
        return len(self.actors)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call(self, method: str, *args: Any, timeout_s: float | None = None, what: str = "", **kwargs: Any) -> list:
        refs = self.submit(method, *args, **kwargs)
        label = f"{self.name}.{method}({what}) on {len(self.actors)} actor(s)"
        return self.gather(refs, timeout_s or self.timeout_s, label)

    def gather(self, refs: list[ray.ObjectRef], timeout_s: float, label: str) -> list:
        """The results, in rank order. Fails as soon as one rank fails (the others may be blocked in a
        collective with it: waiting for them would last the collective timeout), naming that rank;
        on timeout, names the ranks that had not answered."""
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = [refs.index(r) for r in pending]
                raise RemoteTimeout(f"timed out after {timeout_s:.0f}s waiting for {label}: rank(s) {late} did not answer")
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as err:
                rank = refs.index(done[0])
                raise TrainerDiedError(f"{self.name} rank {rank} died during {label}: {death_reason(err)}") from None
        return ray.get(refs)

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


# ---------------------------------------------------------------- when an actor dies


def _ray_logs_dir() -> Path | None:
    """This node's Ray log folder, when this process started or joined Ray on this node."""
    try:
        from ray._private.worker import _global_node  # no public API names the folder

        return Path(_global_node.get_logs_dir_path()) if _global_node is not None else None
    except (ImportError, AttributeError):
        return None


def log_tail(pid: int, lines: int = 15) -> str:
    """The last lines of a Ray worker's stdout and stderr files, found by its pid."""
    logs = _ray_logs_dir()
    files = sorted(logs.glob(f"worker-*-{pid}.*")) if logs is not None else []
    parts = []
    for f in files:
        # Ray starts each file with ":job_id:"-style marker lines; they say nothing about the death.
        text = [line for line in f.read_text(errors="replace").splitlines()
                if line.strip() and not line.startswith(":")][-lines:]
        if text:
            parts.append(f"  last lines of {f}:\n" + "\n".join(f"    {line}" for line in text))
    if not parts:
        where = f" in {logs}" if logs is not None else " (on its node, under /tmp/ray/session_latest/logs)"
        return f"  its log files (worker-*-{pid}.out/.err){where} are empty or missing"
    return "\n".join(parts)


def death_reason(err: Exception) -> str:
    """Ray's exit type and detail from an ActorDiedError, in one line."""
    text = str(err)
    kind = re.search(r"Worker exit type: (\S+)", text)
    detail = re.search(r"Worker exit detail: (.*?\.)(?: |$)", text, flags=re.S)
    if kind is None and detail is None:
        return text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return ", ".join(m.group(1).strip() for m in (kind, detail) if m is not None)


def dead_actors(actors: dict[str, tuple[Any, int | None]], timeout_s: float = 10.0) -> list[str]:
    """Which of the named actors (handle, pid) are dead or unresponsive, each with Ray's reason and
    the tail of its log: what a failed call to them should say instead of a connection error."""
    reports = []
    for name, (actor, pid) in actors.items():
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            reports.append(f"{name} (pid {pid}) did not answer a liveness check within {timeout_s:.0f}s")
        except ray.exceptions.RayActorError as err:
            reports.append(f"{name} (pid {pid}) died: {death_reason(err)}\n{log_tail(pid) if pid else ''}".rstrip())
    return reports
