"""Streamed responses from the embedded engine's server over loopback: SGLang's /generate and OpenAI's
completions and chat, as server-sent events that add up to the non-streamed response."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import engine_server

pytestmark = pytest.mark.integration

SEEDED = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with engine_server(tiny_model_dir) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def events(client: httpx.Client, path: str, body: dict) -> list:
    """The stream's data payloads in order; the last one is the string "[DONE]"."""
    out = []
    with client.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    assert out and out[-1] == "[DONE]"
    return out[:-1]


def test_generate_streams_each_step_and_ends_with_the_whole_response(client):
    body = {"input_ids": [5, 6, 7], "sampling_params": SEEDED, "return_logprob": True}
    whole = client.post("/generate", json=body).json()
    streamed = events(client, "/generate", {**body, "stream": True})
    assert streamed[-1]["meta_info"].pop("id") != whole["meta_info"].pop("id")  # each request its own rid
    assert streamed[-1] == whole
    partial = streamed[:-1]
    assert len(partial) >= 3 and all(e["meta_info"]["finish_reason"] is None for e in partial)
    lengths = [len(e["output_ids"]) for e in partial]
    assert lengths == sorted(set(lengths)) and lengths[-1] < 10  # cumulative, growing every step
    for e in partial:  # every event is a prefix of the final response
        assert whole["output_ids"][: len(e["output_ids"])] == e["output_ids"]
        assert whole["text"].startswith(e["text"])
        assert [lp for lp, _, _ in e["meta_info"]["output_token_logprobs"]] == \
            [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"][: len(e["output_ids"])]]


def test_a_stop_string_is_never_streamed(client):
    free = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**SEEDED, "max_new_tokens": 14}}).json()
    stop = free["text"][4:6]
    body = {"input_ids": [5, 6, 7], "sampling_params": {**SEEDED, "max_new_tokens": 14, "stop": stop}}
    whole = client.post("/generate", json=body).json()
    streamed = events(client, "/generate", {**body, "stream": True})
    assert streamed[-1]["text"] == whole["text"] == free["text"][: free["text"].find(stop)]
    assert all(stop not in e["text"] for e in streamed)
    completion = events(client, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 14, "seed": 7,
                                                    "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in completion) == whole["text"]


def test_openai_completions_stream_adds_up_to_the_completion(client):
    body = {"prompt": "1+2=", "max_tokens": 8, "seed": 3}
    whole = client.post("/v1/completions", json=body).json()
    chunks = events(client, "/v1/completions", {**body, "stream": True})
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_openai_chat_stream_role_deltas_and_usage(client):
    body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 8, "seed": 5}
    whole = client.post("/v1/chat/completions", json=body).json()
    chunks = events(client, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert content == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def in_core(server) -> int:
    load = server.core.load()
    return load["running"] + load["waiting"]


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_client_that_leaves_aborts_its_request(client, server):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}, "stream": True}
    generated = server.core.stats["generated_tokens"]
    server.core.pause()  # the request waits in the engine: only an abort can take it out while paused
    try:
        with client.stream("POST", "/generate", json=body) as reply:
            assert reply.status_code == 200
            assert wait_until(lambda: in_core(server) == 1)
        assert wait_until(lambda: in_core(server) == 0), "the request stayed in the engine after its client left"
    finally:
        server.core.resume()
    assert server.core.stats["generated_tokens"] == generated


def test_stream_refusals_are_4xx_before_any_event(client):
    batch = client.post("/generate", json={"input_ids": [[5, 6], [7, 8]], "stream": True})
    assert batch.status_code == 400 and "one prompt" in batch.text
    too_long = client.post("/generate", json={"input_ids": [5, 6], "stream": True,
                                              "sampling_params": {"max_new_tokens": 500}})
    assert too_long.status_code == 400 and "positions" in too_long.text
