"""The engine server's refusals, over real HTTP: the API key on control routes, body and queue
bounds, range-checked sampling parameters, and a weight-group join that cannot hold the server."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import psutil
import pytest
import torch
from safetensors.torch import save as save_safetensors

from tether.engine.core import EngineCore
from tether.engine.embedded import EmbeddedEngine
from tether.engine.server import EngineServer
from tether.models.hf import load_tokenizer
from tether.http.client import engine_headers
from tether.http.guard import ServerLimits

pytestmark = pytest.mark.integration

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SAMPLING = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}


def start(model_dir, limits: ServerLimits) -> EngineServer:
    core = EngineCore(EmbeddedEngine(str(model_dir)), load_tokenizer(str(model_dir)), max_batch=8)
    return EngineServer(core, limits=limits).start()


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    srv = start(tiny_model_dir, ServerLimits(api_key=KEY, max_body_bytes=1 << 20, max_in_flight=2,
                                             join_timeout_s=2.0))
    yield srv
    srv.stop()


@pytest.fixture()
def client(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        yield c


def generate(client, headers=None, **sampling):
    return client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**SAMPLING, **sampling}},
                       headers=headers)


CONTROL = [("/release_memory_occupation", {"tags": ["kv_cache"]}), ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
           ("/pause_generation", {}), ("/continue_generation", {}), ("/abort_request", {"abort_all": True}),
           ("/flush_cache", {}), ("/update_weights_from_tensor", {"serialized_named_tensors": ""}),
           ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                           "world_size": 2}),
           ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})]


@pytest.mark.parametrize("path,body", CONTROL, ids=[p for p, _ in CONTROL])
def test_control_routes_need_the_key(client, path, body):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        reply = client.post(path, json=body, headers=headers)
        assert reply.status_code == 401, (path, headers, reply.text)
        assert path in reply.json()["detail"] and "Bearer" in reply.json()["detail"]


def test_the_key_opens_control_routes_and_generation_stays_open(client):
    assert client.post("/flush_cache", headers=AUTH).status_code == 200
    assert client.post("/pause_generation", headers=AUTH).status_code == 200
    assert client.post("/continue_generation", headers=AUTH).status_code == 200
    assert generate(client).status_code == 200  # require_key_for_generate is off
    assert client.get("/health").status_code == 200


def test_tethers_engine_clients_send_the_key_from_the_environment(monkeypatch, keyed):
    monkeypatch.setenv("TETHER_API_KEY", KEY)
    with httpx.Client(base_url=keyed.url, timeout=30, headers=engine_headers()) as c:
        assert c.post("/flush_cache").status_code == 200
    monkeypatch.delenv("TETHER_API_KEY")
    assert engine_headers() == {}


def test_generation_can_require_the_key_too(tiny_model_dir):
    srv = start(tiny_model_dir, ServerLimits(api_key=KEY, require_key_for_generate=True))
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert generate(c).status_code == 401
            assert c.get("/get_model_info").status_code == 401
            assert generate(c, headers=AUTH).status_code == 200
            assert c.get("/health").status_code == 200  # health checks never need it
    finally:
        srv.stop()


def test_a_huge_body_is_refused_before_it_is_read(client, keyed):
    rss = psutil.Process().memory_info().rss
    body = b'{"input_ids": [' + b"1," * (25 << 20) + b'1]}'  # 50 MB
    start_s = time.monotonic()
    reply = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 413 and "at most 1048576" in reply.json()["detail"]
    assert time.monotonic() - start_s < 10
    assert psutil.Process().memory_info().rss - rss < 200 << 20  # the client's 50 MB, never the server's copies

    def chunks():  # no Content-Length: counted while read, cut off at the limit
        for _ in range(64):
            yield b" " * (64 << 10)

    reply = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413


BAD_SAMPLING = [
    ("temperature", float("nan"), 422), ("temperature", float("inf"), 422), ("top_p", float("nan"), 422),
    ("min_p", float("-inf"), 422), ("temperature", -1, 422), ("top_k", -5, 422), ("max_new_tokens", 0, 422),
    ("top_k", 10**9, 400), ("stop_token_ids", [10**6], 400), ("max_new_tokens", 10**6, 400), ("max_new_tokens", 100, 400),
    ("sampling_seed", "x", 422), ("tempertaure", 1.0, 422),
]


@pytest.mark.parametrize("field,value,status", BAD_SAMPLING, ids=[f"{f}={v}" for f, v, _ in BAD_SAMPLING])
def test_every_sampling_parameter_is_range_checked_naming_it(client, field, value, status):
    body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {**SAMPLING, field: value}})  # NaN as JSON's NaN
    reply = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    assert field in reply.json()["detail"], reply.text
    if (field, value) == ("max_new_tokens", 100):  # inside the KV budget, past the tiny model's 64 positions
        assert "64 positions" in reply.json()["detail"]


def test_a_weight_update_in_the_wrong_dtype_is_refused_naming_the_tensor(client):
    name = "model.norm.weight"
    payload = base64.b64encode(save_safetensors({name: torch.ones(32, dtype=torch.float64)})).decode()
    reply = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": payload}, headers=AUTH)
    assert reply.status_code == 400 and name in reply.json()["detail"] and "float64" in reply.json()["detail"]


def test_a_join_naming_a_dead_address_times_out_and_does_not_hold_the_server(client):
    body = {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 2}
    replies = {}

    def join(key):
        replies[key] = client.post("/init_weights_update_group", json=body, headers=AUTH)

    first = threading.Thread(target=join, args=("first",))
    start_s = time.monotonic()
    first.start()
    time.sleep(0.3)
    join("second")  # while the first still waits: refused at once
    assert replies["second"].status_code == 409
    assert generate(client).status_code == 200 and client.get("/health").status_code == 200
    first.join(timeout=30)
    assert replies["first"].status_code == 504 and "127.0.0.1:9" in replies["first"].json()["detail"]
    assert time.monotonic() - start_s < 15  # join_timeout_s is 2 s


def test_requests_past_the_queue_limit_get_429(client):
    assert client.post("/pause_generation", headers=AUTH).status_code == 200
    held: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: held.append(generate(client))) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while client.get("/health").json()["waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        reply = generate(client)  # the third while two wait: refused, not queued
        assert reply.status_code == 429 and "server.max_queued_requests" in reply.json()["detail"]
    finally:
        client.post("/continue_generation", headers=AUTH)
        for t in threads:
            t.join(timeout=30)
    assert [r.status_code for r in held] == [200, 200]
