"""The embedded engine on a GPU (needs a CUDA GPU; skipped without one). Nothing but torch,
transformers and the HTTP stack: it runs in the GPU check (scripts/gpu_check.sh) on a bare machine.

    contract     the whole engine contract suite against the embedded engine's server on CUDA (generate,
                 health, abort, pause, memory by tag, pushes, the tied embedding, LoRA pushes)
    mismatch     a short sampled rollout: the engine's log-probs (float32 on the GPU) against a float32
                 HF forward on CPU, mean |diff| < 1e-3
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from tests.gpu.conftest import contract_tests, rollout_logprob_diffs, run_contract_test

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


@pytest.mark.parametrize("name", contract_tests())
def test_engine_contract(name, backend, model_dir):
    run_contract_test(name, backend, model_dir)


def test_a_short_rollout_matches_an_hf_forward(http, backend, model_dir):
    diffs = rollout_logprob_diffs(http, backend[1](), model_dir)
    assert sum(diffs) / len(diffs) < 1e-3, f"mean |logprob diff| {sum(diffs) / len(diffs):.2e}, max {max(diffs):.2e}"
