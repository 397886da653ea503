"""What the GPU tests share: the server's Python (its own environment, or this one) and the tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tether.models.tiny import build_char_tokenizer, build_tiny_model

GREEDY = [{"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}]


@pytest.fixture()
def http(backend):
    """A client of the module's ``backend`` engine ((url, state_dict, backend name))."""
    import httpx

    with httpx.Client(base_url=backend[0], timeout=120) as client:
        yield client


def contract_tests(*leave_out: str) -> list[str]:
    """The engine contract suite's tests (tests/integration/test_engine_contract.py), by name."""
    import tests.integration.test_engine_contract as contract

    return [name for name in dir(contract) if name.startswith("test_") and name not in leave_out]


def run_contract_test(name: str, backend, model_dir: Path) -> None:
    """One contract test against ``backend`` ((url, state_dict, backend name), the suite's shape)."""
    import httpx

    import tests.integration.test_engine_contract as contract

    test = getattr(contract, name)
    wants = test.__code__.co_varnames[: test.__code__.co_argcount]
    with httpx.Client(base_url=backend[0], timeout=120) as http:
        test(*[{"http": http, "backend": backend, "vllm_model_dir": model_dir}[arg] for arg in wants])


def server_python_or_skip(package: str, env_var: str) -> str:
    """``env_var``'s Python (a virtual environment with ``package``), else this one if it can import it;
    the test is skipped, saying why, without a CUDA GPU or the package."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    python = os.environ.get(env_var) or sys.executable
    found = subprocess.run([python, "-c", f"import {package}"], capture_output=True, timeout=300)
    if found.returncode != 0:
        pytest.skip(f"{python} cannot import {package} (set {env_var} to an environment that has it)")
    return python


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 (hidden 128, 4 heads of 32: the Triton attention kernels take it)."""
    out = tmp_path_factory.mktemp("gpu_model")
    return build_tiny_model(out, build_char_tokenizer(chat_template=True), hidden_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=256, max_positions=4096, seed=0)


def rollout_logprob_diffs(http, state: dict[str, torch.Tensor], model_dir: Path) -> list[float]:
    """Sampled responses to 8 prompts: |engine log-prob - float32 HF forward log-prob| of every token
    (the trainer/engine mismatch tether reports as mismatch/*)."""
    import tests.integration.test_engine_contract as contract

    prompts = [[5 + i, 6 + i, 7 + 2 * i] for i in range(8)]
    params = [{"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True} for _ in prompts]
    outs = contract.generate(http, prompts, params, rids=[f"mm-{i}" for i in range(8)])
    diffs = []
    for prompt, out in zip(prompts, outs):
        engine = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert len(engine) == len(out["output_ids"]) == 16
        reference = contract.hf_logprobs(model_dir, state, prompt, out["output_ids"])
        diffs += [abs(a - b) for a, b in zip(engine, reference)]
    return diffs


def push_over_nccl_and_back(http, url: str, state: dict[str, torch.Tensor], version: int) -> None:
    """The trainer's rank 0 (a process of its own, on this GPU) broadcasts the weights with the final
    norm negated over an NCCL group the engine joins: the greedy tokens change; the norm goes back."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import tests.integration.test_engine_contract as contract

    before = contract.tokens_of(contract.generate(http, [[5, 6, 7]], GREEDY)[0])
    norm = "model.norm.weight"
    changed = [(n, -t if n == norm else t) for n, t in state.items() if n != "lm_head.weight"]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as trainer:
        trainer.submit(contract.send_over_a_group, url, changed, version + 1, 64 * 1024, "nccl", "cuda").result(timeout=300)
        after = contract.generate(http, [[5, 6, 7]], GREEDY)[0]
        assert contract.tokens_of(after) != before and int(after["meta_info"]["weight_version"]) == version + 1
        trainer.submit(contract.send_over_a_group, url, [(norm, state[norm])], version + 2, 2**20, "nccl", "cuda").result(timeout=300)
    assert contract.tokens_of(contract.generate(http, [[5, 6, 7]], GREEDY)[0]) == before


LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def lora_pushes_serve_the_merged_model(actor, url: str, model_dir: Path, fields: dict, tolerance: float) -> None:
    """A LoRA policy served through the engine's LoRA route (``actor`` started with ``lora=LORA``): two
    pushes of adapters (object-store buckets, as the trainer sends them) and each time the engine's
    log-probs of a sampled reply, asked with ``fields`` (the adapter's name where the engine needs it),
    are an HF forward of the merged model within ``tolerance`` (mean |diff|), and not of the base."""
    import httpx

    import tests.integration.test_engine_contract as contract
    from safetensors.torch import load_file
    from tether.models.hf import load_model
    from tether.models.lora import adapter_state, apply_lora, lora_layers, merged_tensors
    from tether.models.lora_config import LoRAConfig
    from tether.weight_sync.packed import pack_bucket

    base = load_file(str(model_dir / "model.safetensors"))
    torch.manual_seed(0)
    model = load_model(str(model_dir), "float32")
    apply_lora(model, LoRAConfig(**LORA))
    body = {"input_ids": [[5, 6, 7]], "return_logprob": True, **fields,
            "sampling_params": [{"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}]}
    for _ in range(2):
        with torch.no_grad():
            for layer in lora_layers(model).values():
                layer.lora_B.normal_(0, 0.5)
        version = actor.weight_version + 1
        actor.load_weight_bucket(pack_bucket(list(adapter_state(model).items())), version)
        actor.commit_weights(version)
        reply = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        out = reply.json()[0]
        engine = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        merged = {k: v for k, v in merged_tensors(model) if k != "lm_head.weight"}
        expected = contract.hf_logprobs(model_dir, merged, [5, 6, 7], out["output_ids"])
        plain = contract.hf_logprobs(model_dir, base, [5, 6, 7], out["output_ids"])
        mean = sum(abs(a - b) for a, b in zip(engine, expected)) / len(engine)
        assert mean < tolerance, f"mean |logprob diff| {mean:.4f} against the merged model"
        assert sum(abs(a - b) for a, b in zip(expected, plain)) / len(engine) > 4 * tolerance  # it can tell
