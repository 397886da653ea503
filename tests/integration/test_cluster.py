"""Placement, fan-out calls and timeouts on a real local Ray; failures that name their cause."""

from __future__ import annotations

import ast
import json
import time

import pytest
import ray

from tests.conftest import USER_REWARD, tiny_config
from tether.cluster import ActorGroup, RemoteTimeout, plan_placement, wait
from tether.config import ClusterConfig, config_from_dict
from tether.train import train

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0.1)
class Sleeper:
    def __init__(self, rank: int):
        self.rank = rank

    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


def test_wait_times_out_naming_the_call(ray_session):
    actor = Sleeper.remote(0)
    with pytest.raises(RemoteTimeout, match=r"timed out after 1s waiting for sleeper.nap\(rollout 7\)"):
        wait(actor.nap.remote(30), 1, "sleeper.nap(rollout 7)")
    ray.kill(actor)


def test_actor_group_fans_out_and_times_out(ray_session):
    group = ActorGroup([Sleeper.remote(r) for r in range(3)], "sleepers", timeout_s=30)
    assert group.call("nap", 0.0, what="quick") == [0, 1, 2]
    with pytest.raises(RemoteTimeout, match=r"sleepers.nap\(slow\) on 3 actor\(s\)"):
        group.call("nap", 30, what="slow", timeout_s=1)
    group.kill()


# Colocated: max(trainers, engines) shared bundles. Disaggregated: trainer bundles, then engine bundles.
@pytest.mark.parametrize("colocate, expected_bundles, engines", [(True, 3, [0, 1, 2]), (False, 5, [2, 3, 4])])
def test_placement_layouts(ray_session, colocate, expected_bundles, engines):
    cfg = ClusterConfig(num_train_actors=2, num_engines=3, colocate=colocate, cpus_per_bundle=0.5)
    placement = plan_placement(cfg)
    try:
        assert len(placement.group.bundle_specs) == expected_bundles
        assert placement.train_bundles == [0, 1]
        assert placement.engine_bundles == engines
    finally:
        placement.remove()


def test_reward_that_raises_stops_the_run_with_its_name(ray_session, tiny_model_dir, addition_data, tmp_path):
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run", rollout={"reward": f"{USER_REWARD}:broken"})
    with pytest.raises(Exception, match=r"broken") as info:
        train(config_from_dict(raw))
    assert "prompt_index" in str(info.value) or "prompt index" in str(info.value)
    # What was done before the failure is kept: the baseline eval row is on disk.
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[0]["step"] == 0 and "eval/add/score" in rows[0]


LISTENERS = """
import psutil, ray
from tether.cluster import start_ray
from tether.config import ClusterConfig
start_ray(ClusterConfig(ray_num_cpus=2), 1)

@ray.remote
def ping():
    return 1

ray.get(ping.remote())  # a worker process too
ours = [p.pid for p in psutil.Process().children(recursive=True)]
addrs = sorted({c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.pid in ours})
print("LISTEN", addrs, len(ours))
ray.shutdown()
"""


def test_a_local_ray_listens_on_loopback_only():
    """tether's own local Ray (not the test session's): GCS, raylet, object manager and workers."""
    import subprocess
    import sys

    import os

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not the test session's
    out = subprocess.run([sys.executable, "-c", LISTENERS], capture_output=True, text=True, timeout=180, env=env)
    line = next((x for x in out.stdout.splitlines() if x.startswith("LISTEN")), None)
    assert line is not None, out.stderr[-3000:]
    addrs = ast.literal_eval(line.split(" ", 1)[1].rsplit(" ", 1)[0])
    assert addrs and set(addrs) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, line


@pytest.mark.parametrize("cluster,problem", [
    ({"cpus_per_bundle": 64}, "bundle 0 asks for 64 CPU and no node has that much"),
    ({"num_train_actors": 3, "colocate": True, "cpus_per_bundle": 3}, "its 3 bundles ask for 9 CPU in all")],
    ids=["a-bundle-no-node-has", "more-than-the-cluster"])
def test_a_placement_group_that_cannot_fit_is_reported_within_seconds(ray_session, cluster, problem):
    from tether.scheduling import Unschedulable

    start = time.monotonic()
    with pytest.raises(Unschedulable) as err:
        plan_placement(ClusterConfig(call_timeout_s=600, **cluster))
    assert time.monotonic() - start < 10
    text = str(err.value)
    assert problem in text and "The cluster has 1 node(s) [8 CPU 0 GPU]" in text


def test_a_rollout_manager_without_room_is_reported_within_seconds(ray_session, tiny_model_dir, addition_data, tmp_path):
    from ray.util.placement_group import placement_group, remove_placement_group

    from tether.rollout.handle import RolloutHandle
    from tether.scheduling import Unschedulable

    free = ray.available_resources().get("CPU", 0)
    hog = placement_group([{"CPU": free}])  # every free CPU taken, as by a placement group of the run
    ray.get(hog.ready(), timeout=30)
    try:
        cfg = config_from_dict(tiny_config(tiny_model_dir, addition_data, tmp_path / "run"))
        start = time.monotonic()
        with pytest.raises(Unschedulable) as err:
            RolloutHandle(cfg, [])
        assert time.monotonic() - start < 15  # the call timeout is 120 s
        text = str(err.value)
        assert "the rollout manager start (loading data) asks for 0.1 CPU outside the placement group" in text
        assert "free now (outside placement groups): 0 CPU" in text
    finally:
        remove_placement_group(hog)
