"""cluster.router: sglang_router: the sglang-router package's cache-aware router in front of tether's
engines (it runs on CPU: a Rust binary, no torch). Generation goes through it, control goes to the
engines directly, and a whole run trains through it."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.conftest import tiny_config
from tether.config import config_from_dict
from tether.train import train

pytestmark = pytest.mark.integration
pytest.importorskip("sglang_router", reason="sglang-router is in the dev extras (pip install sglang-router)")


@pytest.fixture(scope="module")
def two_engines(tiny_model_dir):
    from tether.engine.core import EngineCore
    from tether.engine.embedded import EmbeddedEngine
    from tether.engine.server import EngineServer
    from tether.models.hf import load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    servers = [EngineServer(EngineCore(EmbeddedEngine(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir)),
                                       prefix_cache_tokens=4096)).start() for _ in range(2)]
    yield [s.url for s in servers]
    for s in servers:
        s.stop()
    torch.set_num_threads(threads)


def test_generation_goes_through_the_router_and_shared_prefixes_stay_on_one_engine(two_engines, tmp_path):
    from tether.rollout.router_sglang import SglangRouterFront

    router = SglangRouterFront(two_engines, timeout_s=60, log_dir=str(tmp_path))
    try:
        prefix = list(range(5, 45))  # long enough for the router's prefix tree to prefer its engine
        before = [httpx.get(f"{u}/get_load").json()["requests"] for u in two_engines]
        for turn in range(6):
            out = router.generate({"input_ids": prefix + [50 + turn], "rid": f"t{turn}", "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}})
            assert len(out["output_ids"]) == 3 and len(out["meta_info"]["output_token_logprobs"]) == 3
        after = [httpx.get(f"{u}/get_load").json()["requests"] for u in two_engines]
        served = [a - b for a, b in zip(after, before)]
        assert sorted(s > 0 for s in served) == [False, True], served  # all six turns on one engine
        assert len(router.broadcast("/flush_cache")) == 2  # control still reaches every engine directly
        assert "sglang" in (tmp_path / next(p.name for p in tmp_path.iterdir())).read_text().lower()
    finally:
        router.close()
    assert not router.process.alive()


def test_a_run_trains_through_sglang_router(ray_session, tiny_model_dir, addition_data, tmp_path):
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run",
                      cluster={"num_engines": 2, "router": "sglang_router", "colocate": False})
    train(config_from_dict(raw))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "mismatch/logprob_abs_diff_max" in r]) == 3
    assert max(r["mismatch/logprob_abs_diff_max"] for r in rows if "mismatch/logprob_abs_diff_max" in r) < 1e-4
    assert list((tmp_path / "run" / "engine_logs").glob("sglang_router_*.log"))
