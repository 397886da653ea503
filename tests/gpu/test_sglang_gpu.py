"""The SGLang backend on a real SGLang server (needs a CUDA GPU and SGLang; skipped without them).

SGLang runs with its own Python: TETHER_SGLANG_PYTHON (a virtual environment with sglang installed),
else the Python running the tests if it can import sglang. The model is a tiny Qwen2 (hidden 128,
4 heads) with the character tokenizer.

    contract     the engine contract suite's generate/health/abort/pause/flush tests, against SGLang
    weights      buckets through the actor (the trainer's shared-memory segment and the object store)
                 change the replies and the reported version; restored after
    group        the distributed transport over NCCL: SGLang's /init_weights_update_group joins the
                 group tether's sender builds (SGLang's own construction, weight_sync/group.py), and
                 /update_weights_from_distributed takes the buckets
    memory       release/resume by tag, then a full push brings the weights back
    mismatch     a short sampled rollout: SGLang's log-probs against an HF forward, mean |diff| < 0.05

The contract suite's own weight and memory tests push base64 safetensors to /update_weights_from_tensor,
which is tether's embedded server's payload, not SGLang's (SGLang unpickles that field): here the
same checks go through the actor, which is how the trainer reaches an SGLang engine.
"""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest
import torch
from safetensors.torch import load_file

import tests.integration.test_engine_contract as contract
from tests.gpu.conftest import GREEDY, push_over_nccl_and_back, rollout_logprob_diffs, server_python_or_skip
from tether.engine.sglang import SglangEngineActor
from tether.weight_sync.packed import pack_bucket
from tether.weight_sync.shared_memory import StagingSegment

pytestmark = [pytest.mark.gpu]

@pytest.fixture(scope="module")
def actor(model_dir) -> Iterator[SglangEngineActor]:
    python = server_python_or_skip("sglang", "TETHER_SGLANG_PYTHON")
    cfg = {"python": python, "mem_fraction_static": 0.2, "startup_timeout_s": 600,
           # head size 32: the Triton attention kernels take it; no CUDA graphs for a fast start
           "extra_args": ["--attention-backend", "triton", "--disable-cuda-graph", "--context-length", "4096"]}
    actor = SglangEngineActor(str(model_dir), cfg, dtype="bfloat16", seed=0, log_dir=str(model_dir.parent / "logs"))
    try:
        health = actor.health()
        assert health["backend"] == "sglang" and health["weight_version"] == 0
        yield actor
    finally:
        actor.shutdown()


@pytest.fixture(scope="module")
def state(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture()
def http(actor) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=actor.url(), timeout=120) as client:
        yield client


CONTRACT = [
    pytest.param("test_generate_batch_token_ids_logprobs_and_limits", marks=pytest.mark.xfail(
        strict=False, reason="SGLang's meta_info.weight_version is a string ('0'); the suite asks for an int "
                             "(tether's rollout reads int(...), which takes either)")),
    "test_stop_token_ids_end_a_response",
    "test_a_sampling_seed_fixes_the_tokens",
    "test_a_continued_response_goes_on_where_it_stopped",
    "test_health",
    "test_abort_by_rid_returns_the_partial_response",
    "test_pause_holds_requests_and_continue_resumes_them",
    "test_abort_all",
    "test_flush_cache",
]


@pytest.mark.parametrize("name", CONTRACT)
def test_engine_contract(name, http):
    getattr(contract, name)(http)


def version_of(out: dict) -> int:
    return int(out["meta_info"]["weight_version"])


def test_a_weight_update_through_the_actor_changes_replies_and_the_version(actor, http, state):
    before = contract.tokens_of(contract.generate(http, [[5, 6, 7]], GREEDY)[0])
    version = actor.weight_version
    norm = "model.norm.weight"  # negated: every logit changes sign, so the greedy tokens change
    segment = StagingSegment(1 << 20)
    try:
        actor.load_weight_bucket(segment.write(0, [(norm, -state[norm])]), version + 1)  # same-host segment
        assert actor.commit_weights(version + 1) == version + 1
        after = contract.generate(http, [[5, 6, 7]], GREEDY)[0]
        assert contract.tokens_of(after) != before and version_of(after) == version + 1
        assert int(http.get("/get_model_info").json()["weight_version"]) == version + 1
    finally:
        segment.close()
        actor.load_weight_bucket(pack_bucket([(norm, state[norm])]), version + 2)  # object-store bucket
        actor.commit_weights(version + 2)
    assert contract.tokens_of(contract.generate(http, [[5, 6, 7]], GREEDY)[0]) == before


def test_a_push_over_an_nccl_group_joined_by_sglang(actor, http, state):
    version = actor.weight_version
    push_over_nccl_and_back(http, actor.url(), state, version)
    actor.weight_version = version + 2  # the pushes went around the actor


def test_memory_release_and_resume_by_tag_then_a_full_push(actor, http, state):
    before = contract.tokens_of(contract.generate(http, [[5, 6]], GREEDY)[0])
    for tags in (["kv_cache"], ["weights", "kv_cache"]):
        actor.release_memory(tags)
        assert actor.health()["released"] == sorted(tags)
        actor.resume_memory(tags)
    version = actor.weight_version + 1
    actor.load_weight_bucket(pack_bucket(list(state.items())), version)  # released weights come back with a push
    actor.commit_weights(version)
    out = contract.generate(http, [[5, 6]], GREEDY)[0]
    assert contract.tokens_of(out) == before and version_of(out) == version


def mean_abs_diff(engine: list[float], reference: list[float]) -> float:
    return sum(abs(a - b) for a, b in zip(engine, reference)) / max(len(engine), 1)


def test_a_pushed_tied_embedding_reaches_the_output_layer(actor, http, state, model_dir):
    emb = "model.embed_tokens.weight"
    scaled = {**state, emb: state[emb] * 3}
    version = actor.weight_version
    params = [{"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}]
    try:
        actor.load_weight_bucket(pack_bucket([(emb, scaled[emb])]), version + 1)
        actor.commit_weights(version + 1)
        out = contract.generate(http, [[5, 6, 7]], params)[0]
        engine = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        expected = contract.hf_logprobs(model_dir, scaled, [5, 6, 7], out["output_ids"])
        stale = contract.hf_logprobs(model_dir, scaled, [5, 6, 7], out["output_ids"], head=state[emb])
        assert mean_abs_diff(engine, expected) < 0.05
        assert mean_abs_diff(expected, stale) > 0.1  # the check can tell the two apart
    finally:
        actor.load_weight_bucket(pack_bucket([(emb, state[emb])]), version + 2)
        actor.commit_weights(version + 2)


def test_a_short_rollout_matches_an_hf_forward(http, state, model_dir):
    """SGLang (bfloat16) against a float32 HF forward of the same weights."""
    diffs = rollout_logprob_diffs(http, state, model_dir)
    assert sum(diffs) / len(diffs) < 0.05, f"mean |logprob diff| {sum(diffs) / len(diffs):.4f}, max {max(diffs):.4f}"


def test_lora_adapters_pushed_through_sglangs_lora_route(model_dir):
    """engine.lora_updates: adapter: SGLang with --enable-lora loads each push's adapter folder
    (/unload_lora_adapter, /load_lora_adapter) and serves it to requests naming it (lora_path)."""
    from tests.gpu.conftest import LORA, lora_pushes_serve_the_merged_model
    from tether.engine.backends import LORA_NAME

    python = server_python_or_skip("sglang", "TETHER_SGLANG_PYTHON")
    cfg = {"python": python, "mem_fraction_static": 0.2, "startup_timeout_s": 600,
           "extra_args": ["--attention-backend", "triton", "--disable-cuda-graph", "--context-length", "4096"]}
    actor = SglangEngineActor(str(model_dir), cfg, dtype="bfloat16", seed=0, log_dir=str(model_dir.parent / "logs"),
                              lora=LORA)
    try:
        actor.health()
        lora_pushes_serve_the_merged_model(actor, actor.url(), model_dir, {"lora_path": [LORA_NAME]}, 0.05)
    finally:
        actor.shutdown()
