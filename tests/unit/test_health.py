"""Warnings for runs that cannot learn: each fires on a constructed run, none on a healthy one."""

from __future__ import annotations

import random

from tether.rollout.health import RolloutHealth
from tether.sample import Sample


def samples(rewards: list[float], group: int = 4, finish: str = "stop", logprob: float = -0.5,
            texts: list[str] | None = None) -> list[Sample]:
    out = []
    for i, r in enumerate(rewards):
        text = texts[i] if texts else str(i)
        out.append(Sample(prompt_index=i // group, sample_index=i % group, prompt=f"add {i} 1 =", label="x y",
                          metadata={}, prompt_ids=[1], response_ids=[5] * 3, response_logprobs=[logprob] * 3,
                          response_text=text, finish_reason=finish, reward=r))
    return out


def healthy(rng: random.Random) -> list[Sample]:
    return samples([float(rng.random() < 0.5) for _ in range(32)])


def test_first_rollout_constant_reward_names_the_reward_function():
    health = RolloutHealth(4)
    metrics, warnings = health.after_rollout(0, samples([0.0] * 16))
    assert len(warnings) == 1 and "reward function returned 0.0" in warnings[0]
    assert "prompt   'add 0 1 ='" in warnings[0] and "label    'x y'" in warnings[0]
    assert metrics["rollout/zero_std_group_frac"] == 1.0
    # Still constant: no repeat while the condition holds; again after it cleared and came back.
    assert health.after_rollout(1, samples([0.0] * 16))[1] == []
    assert health.after_rollout(2, healthy(random.Random(0)))[1] == []
    again = health.after_rollout(3, samples([0.0] * 16))[1]
    assert len(again) == 1 and "all 16 rewards of rollout 3 are 0.0" in again[0]


def test_a_batch_solved_at_the_best_reward_is_not_a_warning():
    health = RolloutHealth(4)
    assert health.after_rollout(0, samples([0.0, 1.0] * 8))[1] == []
    assert health.after_rollout(1, samples([1.0] * 16))[1] == []
    assert health.after_rollout(2, samples([0.5] * 16))[1] != []


def test_failing_groups_warn_after_a_streak():
    health = RolloutHealth(4)
    # Nine groups fail on every sample, one succeeds on every sample: rewards differ, no group varies.
    grouped = [0.0] * 36 + [1.0] * 4
    fired = [health.after_rollout(k, samples(grouped))[1] for k in range(6)]
    assert [len(w) for w in fired] == [0, 0, 0, 0, 1, 0]
    assert "90% of groups failed every sample in each of the last 5 rollouts" in fired[4][0]
    assert health.after_rollout(6, samples(grouped))[0]["rollout/zero_std_group_frac"] == 1.0


def test_solved_groups_are_not_a_warning():
    health = RolloutHealth(4)
    solved = [1.0] * 36 + [0.0] * 4  # most groups right on every sample: the task is learned
    assert all(health.after_rollout(k, samples(solved))[1] == [] for k in range(8))


def test_truncated_responses_warn():
    health = RolloutHealth(4)
    _, warnings = health.after_rollout(0, samples([0.0, 1.0] * 8, finish="length"))
    assert len(warnings) == 1 and "100% of the responses of rollout 0 hit max_response_len" in warnings[0]


def test_eval_collapse_needs_a_rising_share_and_falling_entropy():
    health = RolloutHealth(4)
    varied = [str(i) for i in range(16)]
    health.after_rollout(0, samples([0.0, 1.0] * 8, logprob=-0.5))
    metrics, warnings = health.after_eval("task", samples([0.0, 1.0] * 8, texts=varied), 0.25, 0.25)
    assert metrics["eval/task/top_answer_share"] == 1 / 16 and warnings == []
    collapsed = ["7"] * 14 + ["1", "2"]
    # Share up but entropy unchanged: not a collapse yet.
    health.after_rollout(1, samples([0.0, 1.0] * 8, logprob=-0.5))
    assert health.after_eval("task", samples([0.0, 1.0] * 8, texts=collapsed), 0.25, 0.25)[1] == []
    health.after_rollout(2, samples([0.0, 1.0] * 8, logprob=-0.1))
    _, warnings = health.after_eval("task", samples([0.0, 1.0] * 8, texts=collapsed), 0.25, 0.25)
    assert len(warnings) == 1 and "88% of its responses are '7'" in warnings[0]
    assert "best constant answer scores 0.250" in warnings[0]


def test_a_healthy_run_gets_no_warning():
    rng, health = random.Random(1), RolloutHealth(4)
    for k in range(30):
        assert health.after_rollout(k, healthy(rng))[1] == []
        texts = [str(rng.randint(0, 99)) for _ in range(16)]
        scored = samples([float(rng.random() < 0.5) for _ in range(16)], texts=texts)
        assert health.after_eval("task", scored, 0.5, 0.1)[1] == []


def test_first_eval_scoring_every_sample_alike_names_the_reward():
    health = RolloutHealth(4)
    texts = [str(i) for i in range(16)]
    # All 0 at the first eval may be a starting model meant to score 0: said only when the second eval,
    # after some training, scores every sample 0 again.
    assert health.after_eval("add2", samples([0.0] * 16, texts=texts), 0.0, 0.0, "math", step=0)[1] == []
    _, warnings = health.after_eval("add2", samples([0.0] * 16, texts=texts), 0.0, 0.0, "math", step=10)
    assert len(warnings) == 1 and ("eval 'add2' scored 0.0 on every one of its 16 samples at its first eval "
                                   "(step 0) and again at step 10") in warnings[0]
    assert "the reward 'math'" in warnings[0] and "label    'x y'" in warnings[0]
    # Not again: later all-zero evals are a model that got worse, not a wrong reward.
    assert health.after_eval("add2", samples([0.0] * 16, texts=texts), 0.0, 0.0, "math", step=20)[1] == []
    # A set that starts at 0 and learns gets no warning; one that scores every sample 1 at once does.
    learns = RolloutHealth(4)
    assert learns.after_eval("add2", samples([0.0] * 16, texts=texts), 0.0, 0.0, "math")[1] == []
    assert learns.after_eval("add2", samples([0.0, 1.0] * 8, texts=texts), 0.5, 0.0, "math", step=10)[1] == []
    _, warnings = RolloutHealth(4).after_eval("add2", samples([1.0] * 16, texts=texts), 1.0, 1.0, "math")
    assert len(warnings) == 1 and "scored 1.0 on every one of its 16 samples at its first eval, with" in warnings[0]


def test_an_eval_falling_below_its_best_warns_once():
    health, texts = RolloutHealth(4), [str(i) for i in range(16)]
    scores = [(0, 0.50), (10, 0.90), (20, 0.85), (30, 0.78), (40, 0.70), (50, 0.95), (60, 0.80)]
    fired = {step: health.after_eval("task", samples([0.0, 1.0] * 8, texts=texts), score, 0.1, step=step)[1]
             for step, score in scores}
    # 0.85 is noise; 0.78 is 0.12 below the best of step 10 and warns; 0.70 is the same fall, not a new one.
    assert [step for step, w in fired.items() if w] == [30, 60]
    assert fired[30][0].startswith("eval 'task' fell to 0.780 at step 30, from its best 0.900 at step 10")
    assert "from its best 0.950 at step 50" in fired[60][0]
