"""The embedded engine on a GPU (needs a CUDA GPU; skipped without one). Nothing but torch,
transformers and the HTTP stack: it runs in the GPU check (scripts/gpu_check.sh) on a bare machine.

    contract     the whole engine contract suite against the embedded engine's server on CUDA (generate,
                 health, abort, pause, memory by tag, pushes, the tied embedding, LoRA pushes)
    mismatch     a short sampled rollout: the engine's log-probs (float32 on the GPU) against a float32
                 HF forward on CPU, mean |diff| < 1e-3
"""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest
import torch

import tests.integration.test_engine_contract as contract
from tests.gpu.conftest import rollout_logprob_diffs

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def backend(model_dir) -> Iterator[tuple[str, object]]:
    """(url, state_dict, backend name), the shape the contract suite's tests take."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tether.engine.core import EngineCore
    from tether.engine.embedded import EmbeddedEngine
    from tether.engine.server import EngineServer
    from tether.models.hf import load_tokenizer

    engine = EmbeddedEngine(str(model_dir), device="cuda")
    server = EngineServer(EngineCore(engine, load_tokenizer(str(model_dir)))).start()
    try:
        yield server.url, lambda: {k: v.detach().cpu() for k, v in engine.model.state_dict().items()}, "embedded"
    finally:
        server.stop()


@pytest.fixture()
def http(backend) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=backend[0], timeout=120) as client:
        yield client


CONTRACT = [name for name in dir(contract) if name.startswith("test_")]


@pytest.mark.parametrize("name", CONTRACT)
def test_engine_contract(name, http, backend, model_dir):
    test = getattr(contract, name)
    wants = test.__code__.co_varnames[: test.__code__.co_argcount]
    test(*[{"http": http, "backend": backend, "vllm_model_dir": model_dir}[arg] for arg in wants])


def test_a_short_rollout_matches_an_hf_forward(http, backend, model_dir):
    diffs = rollout_logprob_diffs(http, backend[1](), model_dir)
    assert sum(diffs) / len(diffs) < 1e-3, f"mean |logprob diff| {sum(diffs) / len(diffs):.2e}, max {max(diffs):.2e}"
