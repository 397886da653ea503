"""Failed samples outside any engine: fault injection, the failure log and budgets, and what the batch,
the reward metrics, the health checks and an eval make of a failed sample (never a reward of 0)."""

from __future__ import annotations

import math

import pytest

from tether.errors import EnvironmentFailure, RolloutFailed, ToolFailure
from tether.rollout.failures import FailureLog, FailurePolicy, check_trained, classify
from tether.rollout.health import RolloutHealth
from tether.rollout.results import rollout_metrics, to_train_batch
from tether.run.faults import CURRENT_SAMPLE, INJECT_FAULTS, SampleCall, inject_fault
from tether.sample import Sample


def sample(k: int, j: int, reward: float | None = 1.0) -> Sample:
    return Sample(prompt_index=k, sample_index=j, prompt="p", label="1", metadata={}, prompt_ids=[1, 2],
                  response_ids=[3, 4], response_logprobs=[-0.1, -0.2], reward=reward, rollout_id=0,
                  finish_reason="stop", status="completed")


def test_injected_faults_hit_the_same_calls_at_about_the_rate(monkeypatch):
    monkeypatch.setenv(INJECT_FAULTS, "tool=0.1,reward=0.3,seed=4")
    keys = [(0, k, j, 1) for k in range(100) for j in range(10)]
    tool = [inject_fault("tool", key) for key in keys]
    assert tool == [inject_fault("tool", key) for key in keys]  # the same calls, every time
    assert 0.07 < sum(tool) / len(tool) < 0.13
    assert 0.26 < sum(inject_fault("reward", key) for key in keys) / len(keys) < 0.34
    assert not any(inject_fault("environment", key) for key in keys)  # not named: never
    monkeypatch.setenv(INJECT_FAULTS, "tool=0.1,reward=0.3,seed=5")
    assert [inject_fault("tool", key) for key in keys] != tool  # another seed, other calls


def test_an_injected_tool_fault_is_keyed_on_the_running_sample_and_its_calls(monkeypatch):
    monkeypatch.setenv(INJECT_FAULTS, "tool=0.5")
    assert not inject_fault("tool")  # outside a generate function: nothing to key on
    token = CURRENT_SAMPLE.set(SampleCall((0, 1, 2), attempt=1))
    try:
        first = [inject_fault("tool") for _ in range(40)]
    finally:
        CURRENT_SAMPLE.reset(token)
    token = CURRENT_SAMPLE.set(SampleCall((0, 1, 2), attempt=1))
    try:
        assert [inject_fault("tool") for _ in range(40)] == first  # the k-th call of that attempt
    finally:
        CURRENT_SAMPLE.reset(token)
    assert 5 < sum(first) < 35


def test_failures_are_classified_through_their_causes():
    try:
        try:
            raise ToolFailure("sandbox gone")
        except ToolFailure as err:
            raise RuntimeError("generate function raised") from err
    except RuntimeError as wrapped:
        assert classify(wrapped) == "tool"
    assert classify(EnvironmentFailure("down")) == "environment"
    assert classify(KeyError("x")) == "generate"


def test_the_log_counts_kinds_and_the_budget_names_them():
    a, b, c = sample(0, 0), sample(0, 1), sample(0, 2)
    a.fail("tool", "sandbox gone", 3)
    b.fail("unscored", "returned None")
    c.note_retry("reward")
    log = FailureLog()
    log.add_group([a, b, c])
    assert log.total == 1 and log.unscored == 1 and log.retried == {"reward": 1}
    assert log.metrics() == {"failures/samples": 1.0, "failures/unscored": 1.0, "failures/tool": 1.0,
                             "failures/retried/reward": 1.0}
    assert [r["failure"]["kind"] for r in log.rows] == ["tool", "unscored"]
    log.check(FailurePolicy(max_failed_frac=0.1), 10, "rollout 2")  # 1 of 10 allowed
    with pytest.raises(RolloutFailed, match=r"rollout 2: 1 samples failed \(tool 1\); .*allows 0 of the 9 samples"
                                            r"(.|\n)*prompt_index=0, sample_index=0: tool after 3 attempt\(s\): sandbox gone"):
        log.check(FailurePolicy(max_failed_frac=0.1), 9, "rollout 2")


def test_the_batch_must_keep_its_trained_share():
    samples = [sample(0, j) for j in range(4)]
    samples[0].fail("reward", "boom")
    assert check_trained(samples, FailurePolicy(min_trained_frac=0.5), "rollout 1") == 0.75
    samples[1].fail("unscored", "None")
    samples[2].fail("reward", "boom")
    with pytest.raises(RolloutFailed, match=r"only 25% of its 4 samples can be trained on .*reward 2, unscored 1"):
        check_trained(samples, FailurePolicy(min_trained_frac=0.5), "rollout 1")


def test_a_failed_sample_is_excluded_not_rewarded_zero():
    group = [sample(0, 0, 1.0), sample(0, 1, 0.0), sample(0, 2, 1.0), sample(0, 3, 1.0)]
    group[3].fail("environment", "down", 3)
    metrics = rollout_metrics(group)
    assert metrics["rollout/reward_mean"] == pytest.approx(2 / 3)  # over the three scored ones, not 3/4 or 2/4
    batch = to_train_batch(group, 4, 1.0)
    assert batch.excluded == [False, False, False, True] and batch.loss_masks[3] == [0, 0]
    health, _ = RolloutHealth(4).after_rollout(0, group)
    assert health["rollout/zero_std_group_frac"] == 0.0  # 1, 0, 1 vary
    alone = [sample(1, 0, 1.0)] + [sample(1, j) for j in range(1, 4)]
    for s in alone[1:]:
        s.fail("tool", "x")
    assert rollout_metrics(alone)["rollout/reward_std"] == 0.0
    everything = [sample(2, j) for j in range(2)]
    for s in everything:
        s.fail("tool", "x")
    assert math.isnan(rollout_metrics(everything)["rollout/reward_mean"])
    assert RolloutHealth(2).after_rollout(0, everything) == ({}, [])


def test_the_config_section_becomes_the_policy():
    from tether.rollout.config import FailuresConfig

    policy = FailurePolicy.from_config(FailuresConfig(max_attempts=2, retry=["tool"], failed_groups="shrink",
                                                      on_stall="drop", stall_timeout_s=None))
    assert policy.attempts("tool") == 2 and policy.attempts("reward") == 1
    assert not policy.replace_groups and policy.drop_on_stall and policy.stall_timeout_s is None
    assert FailurePolicy().allowed(64) == 6 and FailurePolicy(max_failed_frac=0).allowed(64) == 0
