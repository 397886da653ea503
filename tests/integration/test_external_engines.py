"""engine.backend: external: a run uses engine servers it did not start (here `tether serve`, a
separate process outside Ray), places nothing for them, and pushes its weights to them over the
distributed transport."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import tiny_config
from tether.config import ConfigError, config_from_dict
from tether.http.server import free_port
from tether.train import train

pytestmark = pytest.mark.integration


@pytest.fixture()
def served(tiny_model_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tether.cli", "serve", "--model", str(tiny_model_dir), "--port",
                             str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_a_run_trains_with_an_engine_it_did_not_start(served, ray_session, tiny_model_dir, addition_data, tmp_path):
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run",
                      cluster={"colocate": False, "weight_sync": "distributed", "num_train_actors": 1,
                               "num_engines": 1, "call_timeout_s": 120, "collective_timeout_s": 60, "torch_threads": 1},
                      engine={"backend": "external", "urls": [served]})
    train(config_from_dict(raw))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "mismatch/logprob_abs_diff_max" in r]
    assert len(trained) == 3
    # The external server got every push (version 3 after 3 rollouts), and it generated with the
    # trainer's weights: engine and trainer log-probs agree to float32 rounding at every step.
    assert httpx.get(f"{served}/get_model_info").json()["weight_version"] == 3
    assert max(r["mismatch/logprob_abs_diff_max"] for r in trained) < 1e-4


def test_external_engines_need_the_distributed_transport_and_matching_counts(tiny_model_dir, addition_data, tmp_path):
    base = tiny_config(tiny_model_dir, addition_data, tmp_path / "run")
    with pytest.raises(ConfigError, match="cluster.weight_sync=distributed"):
        config_from_dict({**base, "engine": {"backend": "external", "urls": ["http://127.0.0.1:1"]}})
    with pytest.raises(ConfigError, match="cluster.num_engines=1"):
        config_from_dict({**base, "cluster": {**base["cluster"], "colocate": False, "weight_sync": "distributed"},
                          "engine": {"backend": "external", "urls": ["http://a:1", "http://b:1"]}})
    with pytest.raises(ConfigError, match="http"):
        config_from_dict({**base, "cluster": {**base["cluster"], "colocate": False, "weight_sync": "distributed"},
                          "engine": {"backend": "external", "urls": ["127.0.0.1:1"]}})
