"""The vLLM backend on a GPU (needs a CUDA GPU and vLLM; skipped without them).

vLLM runs with its own Python: TETHER_VLLM_PYTHON (a virtual environment with vllm installed), else
the Python running the tests if it can import vllm. The model is a tiny Qwen2 (hidden 128, 4 heads)
with the character tokenizer, in float32.

    contract     the whole engine contract suite against the vLLM adapter (generate, health, abort,
                 pause, memory by tag through vLLM's sleep/wake, pushes, the tied embedding)
    group        the distributed transport over NCCL: every vLLM worker joins the trainer's group
                 (tether's worker extension) and receives the broadcast GPU to GPU
    mismatch     a short sampled rollout: vLLM's log-probs against an HF forward, mean |diff| < 0.05
"""

from __future__ import annotations

from typing import Iterator

import pytest
from safetensors.torch import load_file

from tests.gpu.conftest import (contract_tests, push_over_nccl_and_back, rollout_logprob_diffs, run_contract_test,
                               server_python_or_skip)
from tether.engine.vllm import VllmEngineActor

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def backend(model_dir) -> Iterator[tuple[str, object]]:
    """(url, state_dict, backend name), the shape the contract suite's tests take."""
    python = server_python_or_skip("vllm", "TETHER_VLLM_PYTHON")
    actor = VllmEngineActor(str(model_dir), {"python": python, "gpu_memory_utilization": 0.2, "max_model_len": 1024,
                                             "startup_timeout_s": 900},
                            dtype="float32", seed=0, device="cuda", log_dir=str(model_dir.parent / "logs"))
    try:
        assert actor.health()["backend"] == "vllm"
        state = load_file(str(model_dir / "model.safetensors"))
        yield actor.url(), lambda: state, "vllm"
    finally:
        actor.shutdown()


@pytest.mark.parametrize("name", contract_tests("test_a_push_over_the_weight_update_group_changes_replies"))
def test_engine_contract(name, backend, model_dir):
    run_contract_test(name, backend, model_dir)


def test_a_push_over_an_nccl_group_reaches_every_worker(http, backend):
    """Every vLLM worker joins the trainer's group (the worker extension) and loads the broadcast."""
    push_over_nccl_and_back(http, backend[0], backend[1](), http.get("/get_model_info").json()["weight_version"])


def test_a_short_rollout_matches_an_hf_forward(http, backend, model_dir):
    """vLLM (float32 on the GPU) against a float32 HF forward of the same weights."""
    diffs = rollout_logprob_diffs(http, backend[1](), model_dir)
    assert sum(diffs) / len(diffs) < 0.05, f"mean |logprob diff| {sum(diffs) / len(diffs):.4f}, max {max(diffs):.4f}"


def test_lora_adapters_pushed_through_vllms_lora_route(model_dir):
    """engine.lora_updates: adapter on a GPU: vLLM with --enable-lora serves the pushed adapters."""
    from tests.gpu.conftest import LORA, lora_pushes_serve_the_merged_model

    python = server_python_or_skip("vllm", "TETHER_VLLM_PYTHON")
    actor = VllmEngineActor(str(model_dir), {"python": python, "gpu_memory_utilization": 0.2, "max_model_len": 1024,
                                             "startup_timeout_s": 900},
                            dtype="float32", seed=0, device="cuda", log_dir=str(model_dir.parent / "logs"), lora=LORA)
    try:
        actor.health()
        lora_pushes_serve_the_merged_model(actor, actor.url(), model_dir, {}, 0.05)
    finally:
        actor.shutdown()
