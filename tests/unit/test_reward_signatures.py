"""A user's reward in the form it was written: fn(sample), fn(response, label), named fields, verl's
compute_score; relative file specs resolved against the config file's folder."""

from __future__ import annotations

import os

import pytest

from tether.config import ConfigError, load_config
from tether.run.preflight import check_inputs
from tether.rewards import RewardLoadError, compute_rewards, load_reward_fn
from tether.sample import Sample

SCORERS = '''
def by_sample(sample):
    return float(sample.response_text == sample.label)

def by_text(response: str, label) -> float:
    return float(response.strip() == label)

def positional(a, b):
    return float(a == b)

def named(label, prompt, response, metadata):
    return float(response == label and prompt.startswith("q") and metadata["w"] == 1)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth and data_source == "toy" and extra_info["w"] == 1)

async def by_text_async(response, label):
    return float(response == label)

def unclear(x, y, z):
    return 0.0
'''


def sample(response: str, label: str = "1 2") -> Sample:
    return Sample(prompt_index=0, sample_index=0, prompt="q: 2 1", label=label,
                  metadata={"w": 1, "data_source": "toy"}, prompt_ids=[1], response_text=response)


@pytest.fixture()
def scorers(tmp_path):
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS)
    return path


@pytest.mark.parametrize("name", ["by_sample", "by_text", "positional", "named", "compute_score", "by_text_async"])
def test_each_signature_is_called_with_what_it_asks_for(scorers, name):
    fn = load_reward_fn(f"{scorers}:{name}")
    assert compute_rewards(fn, [sample("1 2"), sample("2 1")], name) == [1.0, 0.0]


def test_an_unclear_signature_is_refused_with_the_forms(scorers):
    with pytest.raises(RewardLoadError, match=r"unclear\(x, y, z\).*fn\(sample\), fn\(response, label\)"):
        load_reward_fn(f"{scorers}:unclear")


def test_relative_specs_resolve_against_the_config_folder(tmp_path, scorers):
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "reward.py").write_text(SCORERS)
    (recipe / "run.yaml").write_text(
        "model: {path: m}\nrollout: {reward: reward.py:by_text}\nalgorithm: {policy_loss: ppo_clip}\n"
        "eval: {datasets: [{name: a, path: e.jsonl, reward: ./reward.py:named}, {name: b, path: e.jsonl}]}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cwd = os.getcwd()
    os.chdir(elsewhere)
    try:
        cfg = load_config(recipe / "run.yaml")
        assert cfg.rollout.reward == f"{recipe / 'reward.py'}:by_text"
        assert cfg.eval.datasets[0].reward == f"{recipe / 'reward.py'}:named"
        assert cfg.eval.datasets[1].reward is None and cfg.algorithm.policy_loss == "ppo_clip"
        assert load_reward_fn(cfg.rollout.reward)(sample("1 2")) == 1.0
        # An override is typed in the shell: relative to the working directory.
        (elsewhere / "mine.py").write_text(SCORERS)
        cfg = load_config(recipe / "run.yaml", ["rollout.reward=mine.py:by_sample", "eval.datasets=[]"])
        assert cfg.rollout.reward == f"{elsewhere / 'mine.py'}:by_sample"
        # Built-ins and module specs are left alone.
        assert load_config(recipe / "run.yaml", ["rollout.reward=math"]).rollout.reward == "math"
        assert load_config(recipe / "run.yaml", ["rollout.reward=pkg.mod:fn"]).rollout.reward == "pkg.mod:fn"
    finally:
        os.chdir(cwd)


def test_a_missing_reward_file_is_refused_before_start(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "d.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "run.yaml").write_text(f"model: {{path: {tmp_path / 'm'}}}\ndata: {{path: {tmp_path / 'd.jsonl'}}}\n"
                                       "rollout: {reward: rewards/mine.py:fn}\n")
    with pytest.raises(ConfigError, match=r"rollout.reward: .*rewards/mine.py does not exist \(a relative path"):
        check_inputs(load_config(tmp_path / "run.yaml"), "train")


def test_functions_get_the_configs_args_when_they_name_the_parameter(tmp_path):
    # A user function's own settings (a table, a tool's limits) live in the config's args: section.
    import asyncio

    from tether.config import config_from_dict
    from tether.rollout.user_functions import make_scorer
    from tether.rollout.filters import load_filter
    from tether.sample import Sample

    (tmp_path / "fns.py").write_text(
        "def score(response, label, args):\n"
        "    return float(response.strip() == args['table'][label])\n"
        "async def plain(response, label):\n"
        "    return 1.0\n"
        "def keep(samples, args):\n"
        "    return len(samples) >= args['min_group']\n")
    cfg = config_from_dict({"model": {"path": "m"}, "rollout": {"reward": f"{tmp_path}/fns.py:score"},
                            "args": {"table": {"a": "1"}, "min_group": 3}})
    group = [Sample(0, j, "p", "a", {}, [1], response_text=text) for j, text in enumerate(["1", "2"])]
    asyncio.run(make_scorer(cfg).score_group(group))
    assert [s.reward for s in group] == [1.0, 0.0]
    assert load_filter(f"{tmp_path}/fns.py:keep", args=cfg.args)(group)[0] is False  # 2 < min_group 3
    # A function without the parameter is called as before (async detection kept).
    plain = config_from_dict({"model": {"path": "m"}, "rollout": {"reward": f"{tmp_path}/fns.py:plain"},
                              "args": {"x": 1}})
    asyncio.run(make_scorer(plain).score_group(group))
    assert [s.reward for s in group] == [1.0, 1.0]


TRL_REWARDS = '''
def length_or_none(prompts, completions, completion_ids, answer, **kwargs):
    kwargs["log_metric"]("seen", len(completions))
    return [None if a is None else float(len(ids)) for a, ids in zip(answer, completion_ids)]

def chat(completions, task, **kwargs):
    return [float(c[0]["role"] == "assistant" and c[0]["content"] == "ok" and t == "add")
            for c, t in zip(completions, task)]

async def async_batch(prompts, completions):
    return [1.0 for _ in completions]
'''


def test_trl_batched_rewards_score_a_group_with_its_columns(tmp_path):
    import asyncio

    from tether.rewards.scorer import Scorer

    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_REWARDS)
    group = [Sample(prompt_index=0, sample_index=j, prompt="q", label=label, metadata={"task": "add"}, prompt_ids=[1],
                    response_ids=[5] * (j + 1), response_logprobs=[-1.0] * (j + 1), response_text="ok")
             for j, label in enumerate(["1", None, "3"])]
    asyncio.run(Scorer(f"{path}:length_or_none", label_key="answer").score_group(group))
    assert [s.reward for s in group] == [1.0, None, 3.0]
    assert group[1].failure["kind"] == "unscored" and group[1].remove  # None: not scored, left out
    assert all(s.metrics["seen"] == 3.0 for s in group)
    chat = [Sample(prompt_index=0, sample_index=j, prompt=[{"role": "user", "content": "q"}], label=None,
                   metadata={"task": "add"}, prompt_ids=[1], response_text="ok") for j in range(2)]
    asyncio.run(Scorer(f"{path}:chat").score_group(chat))
    assert [s.reward for s in chat] == [1.0, 1.0]
    fresh = [Sample(prompt_index=0, sample_index=0, prompt="q", label=None, metadata={}, prompt_ids=[1])]
    asyncio.run(Scorer(f"{path}:async_batch").score_group(fresh))
    assert fresh[0].reward == 1.0


def test_verl_extra_info_is_the_rows_own_field():
    from tether.rewards.signature import adapt_reward

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(extra_info == {"split": "train"} and data_source == "gsm8k")

    fn = adapt_reward(compute_score, "compute_score", ValueError)
    s = Sample(prompt_index=0, sample_index=0, prompt="q", label="1", prompt_ids=[1], response_text="1",
               metadata={"data_source": "gsm8k", "extra_info": {"split": "train"}, "ability": "math"})
    assert fn(s) == 1.0
