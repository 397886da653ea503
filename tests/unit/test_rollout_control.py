"""Dynamic-sampling filters, pass@k, the scorer (async, group, dict rewards, post-process) and per-group data draws."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import pytest

from tether.rewards.loader import RewardLoadError
from tether.rewards.scorer import Scorer
from tether.rollout.data_source import DataSource, PromptRow
from tether.rollout.eval_set import pass_at_k, pass_metrics, prompt_pass_rates, reported_ks
from tether.rollout.filters import FilterError, load_filter, nonzero_reward_std
from tether.sample import Sample


def group(rewards, prompt_index=0):
    return [Sample(prompt_index=prompt_index, sample_index=j, prompt="p", label="1", metadata={}, prompt_ids=[1],
                   response_text=str(r), reward=r) for j, r in enumerate(rewards)]


def test_nonzero_reward_std_and_reasons():
    assert nonzero_reward_std(group([0.0, 1.0])) == (True, "")
    assert nonzero_reward_std(group([1.0, 1.0])) == (False, "all_correct")
    assert nonzero_reward_std(group([0.0, 0.0])) == (False, "zero_std")
    assert load_filter(None)(group([0.0, 0.0])) == (True, "")


def test_user_filter_forms(tmp_path):
    path = tmp_path / "filters.py"
    path.write_text("def short(samples):\n    return all(len(s.response_text) < 4 for s in samples)\n"
                    "def why(samples):\n    return False, 'too_easy'\n"
                    "def bad(samples):\n    return 'yes'\n"
                    "def boom(samples):\n    raise KeyError('x')\n")
    assert load_filter(f"{path}:short")(group([1.0])) == (True, "")
    assert load_filter(f"{path}:short")(group([1234.0])) == (False, "filtered")
    assert load_filter(f"{path}:why")(group([1.0])) == (False, "too_easy")
    with pytest.raises(FilterError, match="returned 'yes'"):
        load_filter(f"{path}:bad")(group([1.0]))
    with pytest.raises(FilterError, match="raised KeyError.*prompt_index=5"):
        load_filter(f"{path}:boom")(group([1.0], prompt_index=5))
    with pytest.raises(FilterError, match="unknown built-in filter.*nonzero_reward_std"):
        load_filter("nonzero_std")


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_brute_force(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12)


def test_pass_metrics_per_prompt():
    samples = group([1.0, 0.0, 0.0, 0.0], prompt_index=3) + group([1.0, 1.0, 0.5, 0.0], prompt_index=4)
    rows = prompt_pass_rates(samples, 4, threshold=1.0)
    assert [(r["prompt_index"], r["passed"], r["pass_rate"]) for r in rows] == [(3, 1, 0.25), (4, 2, 0.5)]
    metrics = pass_metrics(rows, 4, "add")
    assert metrics["eval/add/pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert metrics["eval/add/pass@4"] == 1.0
    assert sorted(metrics) == [f"eval/add/pass@{k}" for k in (1, 2, 3, 4)]
    assert pass_metrics(rows[:1], 1, "add") == {}
    assert reported_ks(20) == [1, 2, 4, 8, 16, 20]


def test_scorer_runs_async_rewards_of_a_group_concurrently(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("import asyncio\nasync def slow(response, label):\n    await asyncio.sleep(0.3)\n"
                    "    return float(response == label)\n")
    samples = group([None] * 8)
    samples[0].response_text = "1"
    start = time.perf_counter()
    asyncio.run(Scorer(f"{path}:slow").score_group(samples))
    assert time.perf_counter() - start < 1.5  # 8 x 0.3 s one after the other would be 2.4 s
    assert [s.reward for s in samples] == [1.0] + [0.0] * 7


def test_dict_rewards_need_reward_key(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def parts(sample):\n    return {'acc': 1.0, 'format': 0.5}\n")
    samples = group([None, None])
    asyncio.run(Scorer(f"{path}:parts", reward_key="format").score_group(samples))
    assert samples[0].reward == 0.5 and samples[0].reward_info == {"acc": 1.0, "format": 0.5}
    assert json.loads(json.dumps(samples[0].to_dict()))["reward_info"] == {"acc": 1.0, "format": 0.5}
    assert "set rollout.reward_key" in reward_failure(Scorer(f"{path}:parts"), group([None]))
    assert "without rollout.reward_key 'score'" in reward_failure(Scorer(f"{path}:parts", reward_key="score"),
                                                                 group([None]))


def test_group_reward_and_post_process(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def rank(samples):\n    return [float(i) for i in range(len(samples))]\n"
                    "def short(samples):\n    return [1.0]\n"
                    "def center(samples):\n    m = sum(s.reward for s in samples) / len(samples)\n"
                    "    for s in samples:\n        s.reward -= m\n")
    scorer = Scorer("math", group_reward=f"{path}:rank", post_process=f"{path}:center")
    samples = group([None] * 3)
    asyncio.run(scorer.score_group(samples))
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0]
    scorer.post_process(samples)
    assert [s.reward for s in samples] == [-1.0, 0.0, 1.0]
    assert "returned [1.0] for a group of 3 samples" in reward_failure(
        Scorer("math", group_reward=f"{path}:short"), group([None] * 3))


def test_reward_that_raises_names_the_sample(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def boom(sample):\n    raise ValueError('no answer')\n")
    samples = group([None, None], prompt_index=7)
    samples[1].rollout_id = 3
    error = reward_failure(Scorer(f"{path}:boom", attempts=2), samples)
    assert "raised ValueError: no answer (rollout -1, prompt_index=7, sample_index=0" in error
    assert all(s.failure["attempts"] == 2 and s.reward is None and s.remove for s in samples)


def reward_failure(scorer: Scorer, samples) -> str:
    """The error a sample's reward failed with (a failed reward is the sample's, not the rollout's)."""
    asyncio.run(scorer.score_group(samples))
    assert samples[0].failure is not None and samples[0].failure["kind"] == "reward", samples[0]
    return samples[0].failure["error"]


def test_bad_specs_name_the_field(tmp_path):
    with pytest.raises(RewardLoadError, match="^rollout.group_reward: group reward spec"):
        Scorer("math", group_reward=f"{tmp_path}/missing.py:fn")
    with pytest.raises(RewardLoadError, match="^eval.datasets\\[0\\].reward: reward spec 'nope'"):
        Scorer("nope", field="eval.datasets[0].reward")


def test_peek_and_advance_draw_any_number_of_groups():
    rows = [PromptRow(index=i, line=i + 1, prompt=f"p{i}", label=None, metadata={}, prompt_ids=[1], text=f"p{i}")
            for i in range(10)]
    data = DataSource(rows, prompts_per_rollout=3, n_samples_per_prompt=2, shuffle=False, seed=0)
    groups = data.peek_groups()
    first = [next(groups) for _ in range(5)]
    assert [g[0].prompt_index for g in first] == [0, 1, 2, 3, 4] and len(first[0]) == 2
    data.advance(5)
    assert [g[0].prompt_index for g in data.peek_groups()] == [5, 6, 7, 8, 9]
    data.advance(3)  # 2 left < prompts_per_rollout: the next epoch begins
    assert data.epoch == 1 and next(data.peek_groups())[0].prompt_index == 0
    with pytest.raises(ValueError, match="cannot advance 11"):
        data.advance(11)


def test_bad_functions_fail_before_anything_starts(tmp_path):
    from tether.config import ConfigError, config_from_dict
    from tether.rollout.user_functions import check_user_functions

    user = tmp_path / "fns.py"
    user.write_text("def ok(sample):\n    return 1.0\n")
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "1+1="}\n\n{"prompt": "2+2=", "metadata": {"generate_fn": "agent.py:run"}}\n')
    cfg = config_from_dict({"model": {"path": str(tmp_path)}, "data": {"path": str(data)},
                            "rollout": {"reward": f"{user}:ok", "dynamic_filter": f"{user}:missing",
                                        "group_reward": "no_such_module:fn", "custom_generate_fn": f"{user}:nope"},
                            "algorithm": {"policy_loss": f"{tmp_path}/loss.py:fn"}})
    with pytest.raises(ConfigError) as err:
        check_user_functions(cfg)
    text = str(err.value)
    assert "rollout.group_reward: group reward spec 'no_such_module:fn': module 'no_such_module' not found" in text
    assert f"rollout.dynamic_filter: dynamic filter spec '{user}:missing'" in text and "has no attribute" in text
    assert "algorithm.policy_loss:" in text and "loss.py' not found" in text
    assert f"rollout.custom_generate_fn: generate function spec '{user}:nope'" in text
    # a row's own function, relative to its data file, named by the file and line
    assert f"{data}:3: metadata.generate_fn:" in text and f"'{data.parent}/agent.py' not found" in text


def test_partial_buffer_state_round_trip_and_stale_spans():
    from tether.rollout.buffer import PartialBuffer, mask_stale_spans

    buffer = PartialBuffer()
    g = group([None, None], prompt_index=9)
    g[0].response_ids, g[0].response_logprobs, g[0].status = [4, 5, 6], [-0.5, -1.0, -2.0], "aborted"
    g[0].weight_versions, g[0].span_lengths = [3], [3]
    buffer.put([g])
    restored = PartialBuffer()
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert len(restored) == 1 and restored.groups[0][0] == g[0] and restored.groups[0][1] == g[1]
    assert restored.take()[0][0].response_ids == [4, 5, 6] and len(restored) == 0

    s = g[0]
    s.response_ids += [7, 8]
    s.weight_versions, s.span_lengths = [3, 3], [3, 2]
    assert mask_stale_spans(s) == 0 and s.loss_mask is None  # both spans from the same weights
    s.weight_versions = [3, 4]
    assert mask_stale_spans(s) == 3 and s.loss_mask == [0, 0, 0, 1, 1]
    s.response_ids += [9]
    s.weight_versions, s.span_lengths, s.loss_mask = [2, 4, 5], [3, 2, 1], [1, 1, 0, 1, 1, 1]
    assert mask_stale_spans(s) == 4 and s.loss_mask == [0, 0, 0, 0, 0, 1]  # a 0 already there counts once
    single = group([None])[0]
    single.response_ids, single.weight_versions, single.span_lengths = [1, 2], [1], [2]
    assert mask_stale_spans(single) == 0 and single.loss_mask is None  # one call: left alone
