"""The engine's HTTP API driven by a real client over loopback: SGLang-shaped and OpenAI-shaped."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save as save_safetensors

from tether.engine.core import EngineCore
from tether.engine.embedded import EmbeddedEngine
from tether.engine.server import EngineServer
from tether.rollout.router import NoHealthyWorker, Router
from tether.models.hf import load_tokenizer

from tests.conftest import engine_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # A small KV budget so that the budget test can overfill it.
    with engine_server(tiny_model_dir, max_batch=64, max_batch_tokens=400, prefix_cache_tokens=256) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def gen(client, ids, **sampling):
    reply = client.post("/generate", json={"input_ids": ids, "sampling_params": sampling, "return_logprob": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_generate_shape_and_logprobs(client):
    out = gen(client, [5, 6, 7], max_new_tokens=6, temperature=0.0, ignore_eos=True)
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 6 and meta["completion_tokens"] == 6 and meta["prompt_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    text = client.post("/generate", json={"text": "12+3=", "sampling_params": {"max_new_tokens": 3}}).json()
    assert isinstance(text["text"], str) and "output_token_logprobs" not in text["meta_info"]


def test_batch_request_and_seeds(client):
    body = {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 5, "sampling_seed": 3}}
    first = client.post("/generate", json=body).json()
    second = client.post("/generate", json=body).json()
    assert isinstance(first, list) and len(first) == 2
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in second]  # same seed, same tokens


def test_concurrent_requests_are_batched(client, server):
    results, errors = [], []

    def call(i):
        try:
            results.append(gen(client, [5 + i % 7, 6], max_new_tokens=8, temperature=1.0))
        except Exception as err:  # collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 16
    assert server.core.stats["max_batch_seen"] > 1  # requests shared decode steps


def test_overfull_kv_budget_queues_instead_of_failing(client, server):
    # 8 requests of 3 + 60 = 63 KV tokens against a budget of 400: at most 6 fit at once.
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        gen(client, [5, 6, 7], max_new_tokens=60, ignore_eos=True))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(len(r["output_ids"]) == 60 for r in results)
    too_big = client.post("/generate", json={"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 500}})
    assert too_big.status_code == 400 and "budget" in too_big.json()["detail"]


def test_stop_strings_and_stop_tokens(client):
    free = gen(client, [5, 6, 7], max_new_tokens=12, temperature=0.0, ignore_eos=True)
    text = free["text"]
    assert len(text) >= 4
    stop = text[2:4]
    out = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    token = free["output_ids"][3]
    out = gen(client, [5, 6, 7], max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[token])
    assert out["output_ids"][-1] == token and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_pause_in_abort_mode_aborts_the_running_requests(client):
    # SGLang's pause modes: abort stops what runs (its default); in_place holds it (tether's choice).
    holder = {}
    t = threading.Thread(target=lambda: holder.update(out=gen(client, [5, 6], max_new_tokens=60, ignore_eos=True)))
    t.start()
    deadline = time.monotonic() + 10
    while client.get("/get_load").json()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        assert client.post("/pause_generation", json={"mode": "abort"}).json()["success"]
        t.join(timeout=30)
        assert holder["out"]["meta_info"]["finish_reason"]["type"] == "abort" and len(holder["out"]["output_ids"]) < 60
        assert client.post("/pause_generation", json={"mode": "hold"}).status_code == 422
    finally:
        client.post("/continue_generation", json={})


def test_abort_and_pause_continue(client, server):
    assert client.post("/pause_generation").json()["success"]
    holder = {}
    t = threading.Thread(target=lambda: holder.update(out=gen(client, [5, 6], max_new_tokens=60, ignore_eos=True)))
    t.start()
    time.sleep(0.5)
    assert "out" not in holder  # paused: nothing finishes
    load = client.get("/health").json()
    assert load["paused"] and load["waiting"] + load["running"] >= 1
    assert client.post("/abort_request", json={"abort_all": True}).json()["aborted"] >= 1
    client.post("/continue_generation")
    t.join(timeout=30)
    assert holder["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(holder["out"]["output_ids"]) < 60
    bad = client.post("/abort_request", json={})
    assert bad.status_code == 400


def test_release_resume_and_weight_update(client, server, tiny_model_dir):
    before = gen(client, [5, 6, 7], max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert client.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]}).json()["success"]
    assert all(p.numel() == 0 for p in server.core.engine.model.parameters())  # the memory is really gone
    refused = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 503
    client.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})
    assert client.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}).status_code == 503

    from safetensors.torch import load_file

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    payload = base64.b64encode(save_safetensors(weights)).decode()
    reply = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": payload, "weight_version": 7})
    assert reply.json() == {"success": True, "weight_version": 7}
    again = gen(client, [5, 6, 7], max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert again["output_ids"] == before["output_ids"] and again["meta_info"]["weight_version"] == 7

    changed = {k: (v * 1.5 if "embed" in k else v) for k, v in weights.items()}
    payload = base64.b64encode(save_safetensors(changed)).decode()
    client.post("/update_weights_from_tensor", json={"serialized_named_tensors": payload})
    after = gen(client, [5, 6, 7], max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    client.post("/update_weights_from_tensor", json={"serialized_named_tensors": base64.b64encode(
        save_safetensors(weights)).decode()})


@pytest.mark.parametrize("body, status, words", [
    ({"sampling_params": {"max_new_tokens": 2}}, 422, "exactly one of"),
    ({"input_ids": [5], "sampling_params": {"temprature": 0.5}}, 422, "temprature"),
    ({"input_ids": [5], "sampling_params": {"top_p": 1.5}}, 422, "top_p"),
    ({"input_ids": [], "sampling_params": {"max_new_tokens": 2}}, 400, "empty"),
    ({"input_ids": [[5], [6]], "sampling_params": [{"max_new_tokens": 2}]}, 400, "2 prompts but 1"),
    ({"input_ids": [5, 10**6], "sampling_params": {"max_new_tokens": 2}}, 400, "input_ids[1] = 1000000 is outside"),
    ({"input_ids": [-1, 5], "sampling_params": {"max_new_tokens": 2}}, 400, "input_ids[0] = -1 is outside"),
])
def test_malformed_requests_get_4xx_with_a_message(client, body, status, words):
    reply = client.post("/generate", json=body)
    assert reply.status_code == status, reply.text
    assert words in reply.text
    garbage = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": "bm90IHRlbnNvcnM="})
    assert garbage.status_code == 400 and "safetensors" in garbage.json()["detail"]
    assert client.post("/release_memory_occupation", json={"tags": ["gpu"]}).status_code == 400


@pytest.mark.parametrize("spoil, words", [
    (lambda t: t.clone().index_fill_(0, torch.tensor([0]), float("nan")), "has NaN/inf values"),
    (lambda t: t.clone().index_fill_(0, torch.tensor([1]), float("inf")), "has NaN/inf values"),
    (lambda t: t.to(torch.float64), "is torch.float64, the engine's weights are torch.float32"),
])
def test_non_finite_or_wrong_dtype_weights_are_refused_and_change_nothing(client, server, spoil, words):
    before = gen(client, [5, 6, 7], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    state = server.core.engine.model.state_dict()
    good = "model.layers.0.mlp.up_proj.weight"
    bucket = {good: state[good].clone() * 2, "model.norm.weight": spoil(state["model.norm.weight"])}
    reply = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": base64.b64encode(
        save_safetensors(bucket)).decode(), "weight_version": 99})
    assert reply.status_code == 400 and words in reply.json()["detail"], reply.text
    after = gen(client, [5, 6, 7], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]


def test_prefix_cache_across_requests_flushed_on_demand_and_on_new_weights(client, server):
    client.post("/flush_cache")
    system = list(range(5, 45))  # 40 tokens: 2 whole blocks of 16 and a bit
    first = gen(client, system + [50], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    before = client.get("/get_load").json()["prefix_cache"]
    again = gen(client, system + [50], max_new_tokens=4, temperature=0.0, ignore_eos=True)
    after = client.get("/get_load").json()["prefix_cache"]
    assert after["hit_tokens"] - before["hit_tokens"] == 32 and again["output_ids"] == first["output_ids"]
    assert client.post("/flush_cache").json()["flushed_tokens"] > 0
    assert client.get("/get_load").json()["prefix_cache"]["tokens"] == 0
    gen(client, system, max_new_tokens=2)
    assert client.get("/get_load").json()["prefix_cache"]["tokens"] == 32
    weights = {k: v.clone() for k, v in server.core.engine.model.state_dict().items() if "layers.0.mlp" in k}
    client.post("/update_weights_from_tensor", json={"serialized_named_tensors": base64.b64encode(
        save_safetensors(weights)).decode()})
    gen(client, [5, 6], max_new_tokens=1)  # the next step sees new weights: the old KV goes
    assert client.get("/get_load").json()["prefix_cache"]["tokens"] == 0


def test_weights_updated_in_place_under_a_paused_request_are_reported_per_span(client, server):
    """A request held by /pause_generation keeps its KV cache, continues under the weights pushed
    meanwhile, and its reply says which version sampled which tokens (meta_info.weight_version_spans)."""
    version = server.core.engine.weight_version
    holder = {}
    t = threading.Thread(target=lambda: holder.update(out=gen(client, [5, 6], max_new_tokens=60, ignore_eos=True)))
    t.start()
    deadline = time.monotonic() + 30
    while server.core.load()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # a few tokens under the old weights
    assert client.post("/pause_generation").json()["success"]
    weights = {k: v.clone() for k, v in server.core.engine.model.state_dict().items() if "layers.0.mlp" in k}
    reply = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": base64.b64encode(
        save_safetensors(weights)).decode(), "weight_version": version + 1})
    assert reply.json()["weight_version"] == version + 1
    client.post("/continue_generation")
    t.join(timeout=30)
    meta = holder["out"]["meta_info"]
    spans = meta["weight_version_spans"]
    assert [v for v, _ in spans] == [version, version + 1] and all(n > 0 for _, n in spans), spans
    assert sum(n for _, n in spans) == len(holder["out"]["output_ids"]) == 60
    assert meta["weight_version"] == version + 1
    # A request under one version has no spans list: the single weight_version says it all.
    assert "weight_version_spans" not in gen(client, [5, 6], max_new_tokens=4)["meta_info"]


def test_model_work_runs_on_the_worker_thread_even_while_paused(server):
    core = server.core
    core.pause()
    try:
        assert core.exclusive(lambda: threading.current_thread().name) == "engine-worker"
        with pytest.raises(ZeroDivisionError):  # the caller gets fn's error; the worker goes on
            core.exclusive(lambda: 1 / 0)
    finally:
        core.resume()
    assert core.exclusive(lambda: 7) == 7


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(client, server, monkeypatch):
    """An exception in prefill fails the newcomers (HTTP 500 with the error), never leaves them hanging."""
    batcher = server.core.batcher

    def broken(seqs):
        raise RuntimeError("prefill exploded")

    monkeypatch.setattr(batcher, "prefill", broken)
    reply = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
    assert reply.status_code == 500 and "prefill exploded" in reply.text
    monkeypatch.undo()
    assert len(gen(client, [5, 6], max_new_tokens=3, ignore_eos=True)["output_ids"]) == 3
    assert server.core.load()["running"] == 0


def test_openai_endpoints(client):
    comp = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 4, "logprobs": 1}).json()
    choice = comp["choices"][0]
    assert comp["object"] == "text_completion" and len(choice["logprobs"]["token_logprobs"]) == comp["usage"]["completion_tokens"]
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 4, "logprobs": True}).json()
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert len(chat["choices"][0]["logprobs"]["content"]) == chat["usage"]["completion_tokens"]
    assert client.get("/v1/models").json()["data"][0]["id"]
    assert client.get("/health_generate").status_code == 200


def test_router_spreads_and_health_checks(server, tiny_model_dir):
    engine = EmbeddedEngine(str(tiny_model_dir))
    second = EngineServer(EngineCore(engine, load_tokenizer(str(tiny_model_dir)))).start()
    router = Router([server.url, second.url])
    try:
        payload = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}}
        done = []
        threads = [threading.Thread(target=lambda: done.append(router.generate(payload))) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(done) == 12
        assert all(w.served > 0 for w in router.workers)  # both engines got traffic
        assert all(w.outstanding_requests == 0 for w in router.workers)
        second.stop()
        assert router.check_health(timeout_s=2) == {server.url: True, second.url: False}
        assert router.generate(payload)["output_ids"]  # traffic goes to the healthy one
        router.remove_worker(server.url)
        with pytest.raises(NoHealthyWorker):
            router.generate(payload)
    finally:
        router.close()


def test_health_answers_while_every_request_thread_waits(tiny_model_dir, monkeypatch):
    """Generations wait on their futures in the server's thread pool; an eval of hundreds of problems can
    hold every thread. /health, /get_load and /health_generate answer on the event loop regardless, the
    probe ahead of the queue: here two threads, six slow generations, one running at a time."""
    import tether.engine.server as server_module

    monkeypatch.setattr(server_module, "MAX_CONCURRENT_REQUESTS", 2)
    with engine_server(tiny_model_dir, max_batch=1) as srv:
        core = srv.core
        step = core._step

        def slow_step():  # a slow engine: each request takes ~3 s of steps
            time.sleep(0.1)
            step()

        monkeypatch.setattr(core, "_step", slow_step)
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 30, "temperature": 0.0,
                                                             "ignore_eos": True}}
        workers = [threading.Thread(target=lambda: httpx.post(f"{srv.url}/generate", json=body, timeout=120))
                   for _ in range(6)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 30
        while core.load()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        for route in ("/health", "/get_load", "/health_generate"):
            assert httpx.get(f"{srv.url}{route}", timeout=30).status_code == 200, route
        assert time.monotonic() - start < 3.0  # not behind the 3 s generations holding the threads
        assert core.load()["waiting"] + core.load()["running"] > 0  # they were still there
        for w in workers:
            w.join(timeout=120)
