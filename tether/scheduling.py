"""What cannot be scheduled is said within seconds: what it asked for, and what the cluster has.

Ray keeps a placement group or an actor that does not fit waiting, silently, until someone gives
up. A placement group that no node (or the whole cluster) could ever hold, or an actor outside the
placement group that finds no free CPU for seconds while nothing it waits on is coming, would only
be reported at the call timeout (minutes). These waits poll instead, and say which it is.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import ray

from tether.errors import RemoteTimeout

POLL_S = 1.0
RESOURCES = ("CPU", "GPU")


class Unschedulable(RuntimeError):
    """A placement group or an actor that the cluster cannot hold."""


def describe_cluster() -> str:
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    free = ray.available_resources()
    each = ", ".join(" ".join(f"{n.get(r, 0):g} {r}" for r in RESOURCES) for n in nodes)
    return (f"{len(nodes)} node(s) [{each}], free now (outside placement groups): "
            + ", ".join(f"{free.get(r, 0):g} {r}" for r in RESOURCES))


def never_fits(bundles: list[dict[str, float]]) -> str | None:
    """Why these bundles can never be placed on the cluster as it is (None: they could be)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for k, bundle in enumerate(bundles):
        if not any(all(node.get(r, 0) >= v for r, v in bundle.items()) for node in nodes):
            return f"bundle {k} asks for {_fmt(bundle)} and no node has that much"
    need: Counter[str] = Counter()
    have: Counter[str] = Counter()
    for bundle in bundles:
        need.update(bundle)
    for node in nodes:
        have.update({r: node.get(r, 0) for r in need})
    short = {r: v for r, v in need.items() if v > have[r]}
    return f"its {len(bundles)} bundles ask for {_fmt(dict(need))} in all" if short else None


def wait_placement(ready: Any, bundles: list[dict[str, float]], timeout_s: float, what: str) -> None:
    """Wait for a placement group's ``ready()`` reference; fail at once when it can never be placed."""
    deadline = time.monotonic() + timeout_s
    while not ray.wait([ready], timeout=POLL_S)[0]:
        problem = never_fits(bundles)
        if problem:
            raise Unschedulable(f"the {what} cannot be placed: {problem}. The cluster has {describe_cluster()}. "
                                "Fewer actors, or a smaller cluster.cpus_per_bundle / gpus_per_bundle")
        if time.monotonic() > deadline:
            raise RemoteTimeout(f"timed out after {timeout_s:.0f}s waiting for the {what} (other work holds the "
                                f"resources it needs): the cluster has {describe_cluster()}")
    ray.get(ready)


def unscheduled(actor: Any) -> bool:
    """True while the actor has no worker process yet (waiting for resources)."""
    # Ray's public state API needs the dashboard, which tether's local Ray does not start; the GCS
    # actor table it reads from is available either way.
    from ray._private import state

    info = state.actors(actor._actor_id.hex())
    return bool(info) and info.get("State") == "PENDING_CREATION" and not info.get("Pid")


def wait_started(ref: Any, actor: Any, request: dict[str, float], timeout_s: float, what: str,
                 grace_s: float = 5.0) -> Any:
    """The result of ``ref``, a call on a new ``actor`` outside any placement group; fails within
    seconds when the actor finds no room (its ``request`` exceeds what is free) instead of at the
    timeout."""
    start = time.monotonic()
    while not ray.wait([ref], timeout=POLL_S)[0]:
        waited = time.monotonic() - start
        free = ray.available_resources()
        if waited > grace_s and unscheduled(actor) and any(free.get(r, 0) < v for r, v in request.items()):
            raise Unschedulable(f"the {what} asks for {_fmt(request)} outside the placement group and has not been "
                                f"scheduled after {waited:.0f}s: the cluster has {describe_cluster()}. Leave room "
                                "(cluster.ray_num_cpus, or a smaller cluster.cpus_per_bundle)")
        if waited > timeout_s:
            raise RemoteTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}")
    return ray.get(ref)


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {r}" for r, v in resources.items())
