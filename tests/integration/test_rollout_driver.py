"""The per-group driver against a real engine server over HTTP, and a real reward server.

No Ray here: the driver is what the rollout manager runs inside its actor.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from tests.integration.reward_server import RewardServer
from tether.engine.sampling import SamplingParams
from tether.rewards.scorer import Scorer
from tether.rollout.driver import GroupDriver, Schedule
from tether.rollout.filters import keep_all, nonzero_reward_std
from tether.rollout.fleet import EngineFleet
from tether.sample import Sample

pytestmark = pytest.mark.integration
N = 4  # samples per group


def groups(count: int):
    for k in range(count):
        yield [Sample(prompt_index=k, sample_index=j, prompt=f"{k}+1=", label=None, metadata={},
                      prompt_ids=[5 + k % 10, 6, 7]) for j in range(N)]


def run(engine, schedule, score, keep=keep_all, count=12, params=None, seed=3, groups_source=None):
    driver = GroupDriver(EngineFleet([engine.url], timeout_s=60), timeout_s=60)
    params = params or SamplingParams(temperature=1.0, max_new_tokens=6)
    return driver.run(groups_source or groups(count), schedule, params, seed, score, keep, "test rollout")


async def reward_by_prompt(samples):
    # Prompts 0, 3, 6, ... get the same reward on every sample (the filter drops them); others vary.
    for s in samples:
        s.reward = 1.0 if s.prompt_index % 3 == 0 else float(s.sample_index % 2)


def test_every_group_kept_without_a_filter(engine):
    result = run(engine, Schedule(need=5, over_sampling_groups=5, max_concurrent_groups=2, waves=False),
                 reward_by_prompt)
    assert [g[0].prompt_index for g in result.kept] == [0, 1, 2, 3, 4] and result.consumed == 5
    assert all(s.status in ("completed", "truncated") and s.weight_versions == [0] for g in result.kept for s in g)
    assert result.metrics["rollout/groups_started"] == 5 and result.metrics["rollout/groups_aborted"] == 0
    # Streaming and waves give the same tokens: each sample's seed depends on its place, not its batch.
    waves = run(engine, Schedule(need=5, over_sampling_groups=5, max_concurrent_groups=None, waves=True),
                reward_by_prompt)
    assert [[s.response_ids for s in g] for g in waves.kept] == [[s.response_ids for s in g] for g in result.kept]


@pytest.mark.parametrize("waves", [False, True])
def test_dynamic_filter_keeps_exactly_the_first_passing_groups(engine, waves):
    result = run(engine, Schedule(need=4, over_sampling_groups=5, max_concurrent_groups=3, waves=waves),
                 reward_by_prompt, nonzero_reward_std)
    assert [g[0].prompt_index for g in result.kept] == [1, 2, 4, 5]  # 0 and 3 are all-correct
    assert [s.group_index for g in result.kept for s in g][::N] == [1, 2, 4, 5]  # start order
    m = result.metrics
    assert m["rollout/groups_kept"] == 4 and m["rollout/groups_dropped/all_correct"] == 2
    if waves:  # two waves of 5: everything started is consumed
        assert m["rollout/groups_started"] == 10 and result.consumed == 10 and m["rollout/groups_aborted"] == 0
    else:
        assert result.consumed == 6 and m["rollout/groups_started"] >= 6


@pytest.mark.parametrize("per_request", [2, 3])
def test_groups_sharing_a_request_give_the_same_groups_and_tokens(engine, per_request):
    """groups_per_request batches groups started together: the same kept groups, samples and filter
    decisions as one request per group, in fewer requests."""
    requests = []

    def counting(driver):
        inner = driver.fleet.generate

        async def generate(client, samples, *args, **kwargs):
            requests.append(sorted({s.group_index for s in samples}))
            return await inner(client, samples, *args, **kwargs)

        driver.fleet.generate = generate
        return driver

    def drive(k):
        requests.clear()
        driver = counting(GroupDriver(EngineFleet([engine.url], timeout_s=60), timeout_s=60))
        schedule = Schedule(need=4, over_sampling_groups=6, max_concurrent_groups=5, waves=False, groups_per_request=k)
        result = driver.run(groups(12), schedule, SamplingParams(temperature=1.0, max_new_tokens=6), 3,
                            reward_by_prompt, nonzero_reward_std, "test rollout")
        return result, list(requests)

    one, one_requests = drive(1)
    many, many_requests = drive(per_request)
    assert [g[0].prompt_index for g in many.kept] == [g[0].prompt_index for g in one.kept] == [1, 2, 4, 5]
    assert [[s.response_ids for s in g] for g in many.kept] == [[s.response_ids for s in g] for g in one.kept]
    assert all(len(r) == 1 for r in one_requests)
    # The first requests carry per_request groups each (max_concurrent_groups=5 caps the last of them).
    assert many_requests[0] == list(range(per_request)) and max(len(r) for r in many_requests) == per_request
    assert len(many_requests) < len(one_requests)
    assert many.metrics["rollout/groups_dropped/all_correct"] == 2


def test_data_running_out_is_reported(engine):
    result = run(engine, Schedule(need=4, over_sampling_groups=4, max_concurrent_groups=None, waves=False),
                 reward_by_prompt, nonzero_reward_std, count=4)
    assert result.exhausted and [g[0].prompt_index for g in result.kept] == [1, 2] and result.consumed == 4


def test_groups_in_flight_at_the_cutoff_are_aborted(engine):
    """Group 0 is judged last: while it scores, the engine is paused with later groups on it, so they are
    still generating when the kept set is known and must be aborted, keeping their partial responses."""
    client = httpx.Client(base_url=engine.url, timeout=10)

    async def score(samples):
        if samples[0].prompt_index == 0:
            # Wait until group 2 (started when group 1 finished) is on the engine: rids are <tag>-<group>-<sample>.
            while not any(rid.split("-")[1] == "2" for rid in list(engine.core._running)):
                await asyncio.sleep(0.001)
            client.post("/pause_generation")
            threading.Timer(0.5, lambda: client.post("/continue_generation")).start()
        for s in samples:
            s.reward = 0.0

    params = SamplingParams(temperature=1.0, max_new_tokens=50, ignore_eos=True)
    try:
        result = run(engine, Schedule(need=1, over_sampling_groups=4, max_concurrent_groups=2, waves=False),
                     score, params=params)
    finally:
        time.sleep(0.6)
        client.close()
    assert [g[0].prompt_index for g in result.kept] == [0] and result.consumed == 1
    assert result.unfinished, "no group was in flight at the cutoff"
    for g in result.unfinished:
        assert all(s.status == "aborted" and s.response_length < 50 for s in g)
    m = result.metrics
    assert m["rollout/groups_aborted"] == len(result.unfinished)
    assert m["rollout/samples_aborted"] >= N * len(result.unfinished)

    # Partial rollout: the next rollout continues the aborted groups first, under new weights, with
    # what is left of max_new_tokens; each response records both spans and their versions.
    carried = result.unfinished
    before = {id(s): s.response_length for g in carried for s in g}
    engine.core.engine.weight_version = 1  # as a weight push would set it
    try:
        more = run(engine, Schedule(need=len(carried), over_sampling_groups=len(carried), max_concurrent_groups=None,
                                    waves=False), score_plain, params=params, groups_source=iter(carried))
    finally:
        engine.core.engine.weight_version = 0
    for g in more.kept:
        for s in g:
            assert s.status == "truncated" and s.response_length == 50  # ignore_eos: continued to the limit
            assert s.weight_versions[-1] == 1 and sum(s.span_lengths) == 50
            assert s.span_lengths[0] == before[id(s)] or s.weight_versions == [1]
            assert len(s.response_logprobs) == 50


class LengthFleet(EngineFleet):
    """Each sample generates exactly metadata["tokens"] tokens: a long tail without a trained model."""

    def payload(self, samples, params, seeds, rids):
        payload = super().payload(samples, params, seeds, rids)
        for sp, s in zip(payload["sampling_params"], samples):
            sp["max_new_tokens"] = s.metadata["tokens"] - s.response_length
        return payload


@pytest.mark.parametrize("keep_first_finished", [False, True])
def test_keeping_the_first_to_finish_cuts_the_long_tail(engine, keep_first_finished):
    """Group 0 answers 60 tokens, the others 3. In start order group 0 is kept and the rollout waits for
    it; kept as they finish, the 4 first short groups are kept and group 0 is cut short, to be continued."""
    source = [[Sample(prompt_index=k, sample_index=j, prompt="", label=None, metadata={"tokens": 60 if k == 0 else 3},
                      prompt_ids=[5 + k, 6, 7]) for j in range(N)] for k in range(6)]
    driver = GroupDriver(LengthFleet([engine.url], timeout_s=60), timeout_s=60)
    schedule = Schedule(need=4, over_sampling_groups=6, max_concurrent_groups=None, waves=False,
                        keep_first_finished=keep_first_finished)
    result = driver.run(iter(source), schedule, SamplingParams(temperature=1.0, max_new_tokens=60, ignore_eos=True),
                        0, score_plain, keep_all, "test rollout")
    kept = [g[0].prompt_index for g in result.kept]
    if not keep_first_finished:
        assert kept == [0, 1, 2, 3] and result.consumed == 4
        assert all(s.response_length == 60 for s in result.kept[0])
        return
    assert 0 not in kept and len(kept) == 4 and kept == sorted(kept) and result.consumed == 6
    assert result.unfinished[0] is source[0] and all(0 < s.response_length < 60 and s.status == "aborted"
                                                     for s in source[0])
    assert [g[0].prompt_index for g in result.leftover] == sorted({0, 1, 2, 3, 4, 5} - set(kept))
    m = result.metrics
    assert m["rollout/groups_kept"] == 4 and m["rollout/groups_aborted"] + m["rollout/groups_surplus"] == 2


async def score_plain(samples):
    for s in samples:
        s.reward = 0.0


@pytest.fixture(scope="module")
def reward_server():
    server = RewardServer()
    yield server
    server.close()


def test_remote_reward_server_with_retries(engine, reward_server):
    reward_server.fail_next = 2
    scorer = Scorer(f"{reward_server.url}/score", reward_key="score", timeout_s=5, retries=2)
    result = run(engine, Schedule(need=2, over_sampling_groups=2, max_concurrent_groups=None, waves=False),
                 scorer.score_group)
    samples = [s for g in result.kept for s in g]
    assert all(s.reward == float(bool(s.response_text)) for s in samples)
    assert all(s.reward_info["length"] == s.response_length for s in samples)
    sent = reward_server.requests[-1]["samples"][0]
    assert set(sent) >= {"prompt", "response", "label", "metadata", "prompt_index", "sample_index"}
    assert len(reward_server.requests) == 4  # 2 answered 503 and were retried, then one per group


def reward_error(scorer: Scorer) -> str:
    """The reward failure of a group's samples (every sample of it: one request per group)."""
    group = next(groups(1))
    asyncio.run(scorer.score_group(group))
    assert all(s.failure is not None and s.failure["kind"] == "reward" for s in group)
    return group[0].failure["error"]


def test_remote_reward_errors_name_the_server(engine, reward_server):
    assert re.search(r"/bad.*HTTP 400", reward_error(Scorer(f"{reward_server.url}/bad", retries=3)))
    reward_server.stall_s = 1.5
    try:
        assert "failed 2 time(s): no answer within 1s; no answer within 1s" in reward_error(
            Scorer(f"{reward_server.url}/score", timeout_s=1, retries=1))
    finally:
        reward_server.stall_s = 0.0
    assert re.search("failed 1 time.*ConnectError", reward_error(Scorer("http://127.0.0.1:9/score", retries=0)))
