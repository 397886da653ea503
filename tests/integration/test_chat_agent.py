"""Agents written with the `openai` client, through chat sessions, against a real engine server over
HTTP: the trained tokens are exactly the engine's, equal to the direct path's for the same seeds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tether.engine.sampling import SamplingParams
from tether.rollout.driver import GroupDriver, Schedule
from tether.rollout.filters import keep_all
from tether.rollout.fleet import EngineFleet
from tether.rollout.generate_fn import CustomGenerate, GenerateContext
from tether.sample import Sample
from tether.models.hf import load_tokenizer

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent
N = 3


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def groups(tokenizer, count: int):
    return [[Sample(prompt_index=k, sample_index=j, prompt=f"{k}+1=", label=None, metadata={},
                    prompt_ids=tokenizer.encode(f"{k}+1=", add_special_tokens=False), rollout_id=0)
             for j in range(N)] for k in range(count)]


async def no_score(samples):
    for s in samples:
        s.reward = 0.0


def run(engine, tokenizer, spec: str, count: int = 3):
    driver = GroupDriver(EngineFleet([engine.url], timeout_s=60), timeout_s=60,
                         custom=CustomGenerate(spec, tokenizer=tokenizer))
    # ignore_eos: turn 1 always takes its 3 tokens, so both paths insert the tool's answer at the same place.
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    schedule = Schedule(need=count, over_sampling_groups=count, max_concurrent_groups=None, waves=False)
    return [s for g in driver.run(iter(groups(tokenizer, count)), schedule, params, 11, no_score, keep_all,
                                  "test rollout").kept for s in g]


@pytest.mark.parametrize("agent", ["claude_agent", "responses_agent"])
def test_agents_over_anthropic_and_responses_apis_train_on_the_direct_paths_tokens(engine, tokenizer, agent):
    """The same tool loop written against the anthropic SDK (Messages API) and OpenAI's Responses API,
    streamed (odd samples) and not: the samples are the direct path's, token for token."""
    direct = run(engine, tokenizer, f"{HERE / 'user_generate.py'}:two_turns")
    other = run(engine, tokenizer, f"{HERE / 'user_agents.py'}:{agent}")
    assert len(other) == len(direct) == 3 * N
    for a, d in zip(other, direct):
        assert a.prompt_ids == d.prompt_ids and a.response_ids == d.response_ids and a.loss_mask == d.loss_mask
        assert a.response_logprobs == pytest.approx(d.response_logprobs, abs=1e-4)
        assert a.metrics == {"chat_turns": 2.0, "turns_not_extending": 0.0, "tool_calls": 2.0}


def test_the_openai_agent_trains_on_the_tokens_of_the_direct_path(engine, tokenizer):
    direct = run(engine, tokenizer, f"{HERE / 'user_generate.py'}:two_turns")
    agent = run(engine, tokenizer, f"{HERE / 'user_agents.py'}:echo_agent")
    assert len(agent) == len(direct) == 3 * N
    for a, d in zip(agent, direct):
        assert a.prompt_ids == d.prompt_ids and a.response_ids == d.response_ids
        assert a.loss_mask == d.loss_mask and a.loss_mask[3:6] == [0, 0, 0]  # "<7>" inserted, not trained on
        assert a.span_lengths == d.span_lengths and a.weight_versions == d.weight_versions
        assert a.response_logprobs == pytest.approx(d.response_logprobs, abs=1e-4)
        assert a.metrics == {"chat_turns": 2.0, "turns_not_extending": 0.0, "tool_calls": 2.0}
        assert a.status == "truncated" and a.response_length == 12


def test_a_conversation_that_does_not_extend_its_tokens_keeps_the_engines(engine, tokenizer):
    samples = run(engine, tokenizer, f"{HERE / 'user_agents.py'}:rewriting_agent", count=1)
    for s in samples:
        assert s.metrics["turns_not_extending"] == 1.0
        text = tokenizer.decode(s.prompt_ids)
        # The sample restarted at the second turn: its prompt is that turn's whole prompt, as rendered
        # ("~" the template added, the model's 3 tokens, the tool's answer), its response that turn's.
        assert text.startswith(s.prompt + "~") and text.endswith("<7>") and len(s.prompt_ids) == len(s.prompt) + 7
        assert s.loss_mask is None and s.response_length == 12 and s.span_lengths == [12]  # a fresh response budget


def test_an_abort_ends_the_agent_and_leaves_an_aborted_sample(engine, tokenizer):
    async def main():
        cut = {"now": False}
        async with httpx.AsyncClient() as client:
            ctx = GenerateContext(url=engine.url, client=client, tokenizer=tokenizer, cfg=None, rollout_id=0,
                                  evaluation=False, rid="abort-test", seed=3, is_cut=lambda: cut["now"], timeout_s=30)
            sample = groups(tokenizer, 1)[0][0]
            async with ctx.chat_session(sample, {"max_new_tokens": 60, "temperature": 1.0}) as session:
                chat = session.openai_client()
                first = await chat.chat.completions.create(model="p", messages=[{"role": "user", "content": "1+1="}],
                                                           max_tokens=2)
                cut["now"] = True
                await chat.chat.completions.create(model="p", messages=[
                    {"role": "user", "content": "1+1="}, {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "again"}])
                raise AssertionError("the second call should have failed: the session was aborted")
            return sample

    sample = asyncio.run(main())
    assert sample.status == "aborted" and sample.response_length >= 2 and sample.metrics["chat_turns"] == 2.0


def test_a_streaming_agent_gets_each_turn_as_chunks(engine, tokenizer):
    """Agent code that asks for stream=True (many frameworks do) works: the turn is generated and
    recorded whole, then sent as chat.completion.chunk events."""
    async def main():
        async with httpx.AsyncClient() as client:
            ctx = GenerateContext(url=engine.url, client=client, tokenizer=tokenizer, cfg=None, rollout_id=0,
                                  evaluation=False, rid="stream", seed=3, is_cut=lambda: False, timeout_s=30)
            sample = groups(tokenizer, 1)[0][0]
            async with ctx.chat_session(sample, {"max_new_tokens": 8, "temperature": 1.0}) as session:
                chat = session.openai_client()
                stream = await chat.chat.completions.create(model="p", messages=[{"role": "user", "content": "1+1="}],
                                                            max_tokens=4, stream=True,
                                                            stream_options={"include_usage": True})
                chunks = [chunk async for chunk in stream]
            return sample, chunks

    sample, chunks = asyncio.run(main())
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == sample.response_length == 4


def test_bad_requests_and_unknown_sessions_are_clear_errors(engine, tokenizer):
    async def main():
        async with httpx.AsyncClient() as client:
            ctx = GenerateContext(url=engine.url, client=client, tokenizer=tokenizer, cfg=None, rollout_id=0,
                                  evaluation=False, rid="bad", seed=3, is_cut=lambda: False, timeout_s=30)
            sample = groups(tokenizer, 1)[0][0]
            async with ctx.chat_session(sample, {"max_new_tokens": 8}) as session:
                bad = await client.post(f"{session.base_url}/chat/completions", json={"messages": []})
                stream = await client.post(f"{session.base_url}/chat/completions",
                                           json={"messages": [{"role": "user", "content": "x"}], "stream": True})
                base = session.base_url
            gone = await client.post(f"{base}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            return bad, stream, gone

    bad, stream, gone = asyncio.run(main())
    assert bad.status_code == 400 and "messages: a non-empty list" in bad.text
    assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
    assert stream.text.rstrip().endswith("data: [DONE]")
    assert gone.status_code == 404 and "no open chat session" in gone.text
