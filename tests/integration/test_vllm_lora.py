"""vLLM serving a LoRA run's policy as a LoRA (engine.lora_updates: adapter, the default): the engine
starts vLLM with --enable-lora, loads adapters that change nothing, and every push after is the
adapters alone, saved by vLLM's workers as a PEFT folder and loaded with /v1/load_lora_adapter.
Checked against an HF forward of the merged model, over both ways a push reaches vLLM's workers
(shared memory from an HTTP push, and a broadcast over the weight-update group)."""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest
import torch

from tests.conftest import vllm_python_or_skip
from tests.integration.test_engine_contract import generate, hf_logprobs, push

pytestmark = pytest.mark.integration

LORA = {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}
PARAMS = [{"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5}]


@pytest.fixture(scope="module")
def lora_engine(vllm_model_dir) -> Iterator:
    from tether.engine.vllm import VllmEngineActor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    actor = VllmEngineActor(str(vllm_model_dir), {"python": str(vllm_python_or_skip()), "max_model_len": 256,
                                                  "startup_timeout_s": 600},
                            log_dir=str(vllm_model_dir.parent / "engine_logs"), lora=LORA)
    try:
        actor.health()
        yield actor
    finally:
        actor.shutdown()
        torch.set_num_threads(threads)


def adapted_model(model_dir, seed: int):
    """The base with LoRA on q_proj and v_proj, B drawn so the adapters change the model."""
    from tether.models.hf import load_model
    from tether.models.lora import apply_lora, lora_layers
    from tether.models.lora_config import LoRAConfig

    torch.manual_seed(seed)
    model = load_model(str(model_dir), "float32")
    apply_lora(model, LoRAConfig(**LORA))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0, 1.0)
    return model


def engine_logprobs(http) -> tuple[list[int], list[float]]:
    out = generate(http, [[5, 6, 7]], PARAMS)[0]
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def check_serves(http, model_dir, state: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
    """The engine's log-probs are an HF forward under ``state``, and ``other`` would have told them apart."""
    tokens, engine = engine_logprobs(http)
    expected = hf_logprobs(model_dir, state, [5, 6, 7], tokens)
    assert max(abs(a - b) for a, b in zip(engine, expected)) < 1e-3
    assert max(abs(a - b) for a, b in zip(expected, hf_logprobs(model_dir, other, [5, 6, 7], tokens))) > 0.05


def test_adapter_pushes_serve_the_merged_model(lora_engine, vllm_model_dir):
    from safetensors.torch import load_file

    from tether.models.lora import adapter_state, merged_tensors

    base = load_file(str(vllm_model_dir / "model.safetensors"))
    first, second = adapted_model(vllm_model_dir, 0), adapted_model(vllm_model_dir, 1)
    merged_first = {k: v for k, v in merged_tensors(first) if k != "lm_head.weight"}
    merged_second = {k: v for k, v in merged_tensors(second) if k != "lm_head.weight"}
    with httpx.Client(base_url=lora_engine.url(), timeout=120) as http:
        check_serves(http, vllm_model_dir, base, merged_first)  # the zero adapters: the base, exactly
        version = http.get("/get_model_info").json()["weight_version"]
        adapters = adapter_state(first)
        assert len(adapters) == 8 and all(".lora_" in name for name in adapters)  # 2 layers x q, v x A, B
        push(http, adapters, version + 1)
        assert lora_engine.last_commit_tensors == 8
        check_serves(http, vllm_model_dir, merged_first, base)
        push(http, adapter_state(second), version + 2)  # loaded in place, from a new folder
        check_serves(http, vllm_model_dir, merged_second, merged_first)
        out = generate(http, [[5, 6, 7]], PARAMS)[0]
        assert out["meta_info"]["weight_version"] == version + 2
        assert len(list(lora_engine._adapters.iterdir())) == 1  # earlier folders removed


def test_adapters_over_the_weight_update_group(lora_engine, vllm_model_dir):
    """The distributed transport: the workers receive the broadcast adapters and keep them aside."""
    from safetensors.torch import load_file

    from tether.models.lora import adapter_tensors, merged_tensors
    from tether.weight_sync.distributed import DistributedSender

    base = load_file(str(vllm_model_dir / "model.safetensors"))
    model = adapted_model(vllm_model_dir, 2)
    merged = {k: v for k, v in merged_tensors(model) if k != "lm_head.weight"}
    with httpx.Client(base_url=lora_engine.url(), timeout=120) as http:
        version = http.get("/get_model_info").json()["weight_version"]
        sender = DistributedSender([lora_engine.url()], "127.0.0.1", backend="gloo", bucket_bytes=1 << 20, timeout_s=120)
        try:
            sender.send(adapter_tensors(model), version + 1)
        finally:
            sender.close()
        assert lora_engine.weight_version == version + 1 and lora_engine.last_commit_tensors == 8
        check_serves(http, vllm_model_dir, merged, base)
