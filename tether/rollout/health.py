"""Signs that a run cannot learn, raised as warnings with a sample beside them.

A GRPO step learns only from differences between the rewards of a group. When every reward is the
same, when most groups fail on every sample for many rollouts, or when most responses are cut off, the
loss and gradient are zero or meaningless and the console would only show zeros. When the greedy
eval answers more and more prompts with one answer while the policy's entropy falls, the run is
collapsing onto that answer, which can look like learning when that answer is often right. When an
eval score falls well below its best, training is making the policy worse (often a learning rate too
high for the task), and the final score alone would hide that the run was better earlier.

Each check warns when its condition starts (and again if it returns after clearing); the warning
shows one sample's prompt, response, label and reward so the cause is visible.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from tether.sample import Sample, counted


@dataclass
class HealthThresholds:
    zero_std_frac: float = 0.8
    """Share of groups whose samples all got the low reward (all-equal, below the rollout's mid-range) ..."""
    zero_std_rollouts: int = 5
    """... for this many rollouts in a row."""
    truncated_frac: float = 0.5
    """Share of responses that hit max_response_len."""
    collapse_share: float = 0.6
    """Share of eval responses equal to the most common one ..."""
    collapse_rise: float = 0.2
    """... having risen by at least this much since the first eval ..."""
    collapse_entropy_ratio: float = 0.7
    """... while the sampled tokens' entropy fell below this fraction of the first rollout's."""
    regression_drop: float = 0.1
    """An eval score this far (absolute) below the set's best so far: training is making it worse."""


def _excerpt(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(sample: Sample) -> str:
    prompt = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1].get("content", "")
    return (f"  example (prompt_index {sample.prompt_index}, sample {sample.sample_index}):\n"
            f"    prompt   {_excerpt(prompt)}\n    response {_excerpt(sample.response_text)} "
            f"({sample.response_length} tokens, finish {sample.finish_reason or '?'})\n"
            f"    label    {_excerpt(sample.label)}\n    reward   {sample.reward}")


def group_rewards(samples: list[Sample], group_size: int) -> list[list[float]]:
    """Each group's rewards, without its failed samples (a group with none left is left out)."""
    groups = [[s.scored_reward() for s in samples[k : k + group_size] if not s.failed]
              for k in range(0, len(samples), group_size)]
    return [g for g in groups if g]


def neg_logprob_mean(samples: list[Sample]) -> float:
    """Mean -log p of the sampled tokens: an unbiased estimate of the sampling entropy per token."""
    logprobs = [lp for s in samples for lp in s.response_logprobs]
    return -statistics.fmean(logprobs) if logprobs else 0.0


@dataclass
class RolloutHealth:
    group_size: int
    limits: HealthThresholds = field(default_factory=HealthThresholds)
    _active: set = field(default_factory=set)
    _zero_std_streak: int = 0
    _rollouts_seen: int = 0
    _first_entropy: float | None = None
    _last_entropy: float | None = None
    _first_share: dict = field(default_factory=dict)
    _zero_at_first: dict = field(default_factory=dict)  # eval set -> step of a first eval that scored all 0
    _best_reward: float | None = None
    _best_eval: dict = field(default_factory=dict)

    def _onset(self, key: str, condition: bool) -> bool:
        """True only on the rollout where ``condition`` becomes true."""
        if not condition:
            self._active.discard(key)
            return False
        started = key not in self._active
        self._active.add(key)
        return started

    def after_rollout(self, rollout_id: int, samples: list[Sample]) -> tuple[dict[str, float], list[str]]:
        """Metrics of the rollout's learning signal and the warnings that start with it (over the samples
        that did not fail)."""
        groups = group_rewards(samples, self.group_size)
        samples = counted(samples)
        if not samples:
            return {}, []
        flat = [g[0] for g in groups if len(set(g)) == 1]
        zero_std = len(flat) / len(groups)
        # Groups that all fail are a run that cannot learn; groups that all succeed are a solved task.
        low, high = min(s.scored_reward() for s in samples), max(s.scored_reward() for s in samples)
        failing = sum(v < (low + high) / 2 for v in flat) / len(groups) if high > low else zero_std
        truncated = sum(s.finish_reason == "length" for s in samples) / len(samples)
        entropy = neg_logprob_mean(samples)
        self._first_entropy = entropy if self._first_entropy is None else self._first_entropy
        self._last_entropy = entropy
        self._zero_std_streak = self._zero_std_streak + 1 if failing >= self.limits.zero_std_frac else 0
        first = self._rollouts_seen == 0
        self._rollouts_seen += 1
        rewards = {s.scored_reward() for s in samples}
        # Every sample at the best reward seen so far is a solved batch, not a broken signal.
        solved = not first and self._best_reward is not None and min(rewards) >= self._best_reward
        self._best_reward = max(rewards | ({self._best_reward} if self._best_reward is not None else set()))
        warnings = []
        if self._onset("all_equal", len(rewards) == 1 and not solved):
            value = next(iter(rewards))
            if first:
                warnings.append(f"the reward function returned {value} for every one of the {len(samples)} samples "
                                f"of the first rollout ({rollout_id}): check that it reads the response and the "
                                "label as they are (see the example), or the model never produces a right answer\n"
                                + describe(samples[0]))
            else:
                warnings.append(f"all {len(samples)} rewards of rollout {rollout_id} are {value}: no response is "
                                "better than another, so this rollout teaches nothing\n" + describe(samples[0]))
        streak = self.limits.zero_std_rollouts
        if self._onset("zero_std", self._zero_std_streak >= streak) and len(rewards) > 1:
            mean = statistics.fmean(s.scored_reward() for s in samples)
            warnings.append(f"{failing:.0%} of groups failed every sample in each of the last {streak} rollouts "
                            f"(mean reward now {mean:.3f}): all-equal rewards give GRPO no gradient, so the model "
                            "does not learn on those prompts. More SFT, a higher temperature, more samples per "
                            "prompt, easier prompts, or a check of the reward\n" + describe(samples[0]))
        if self._onset("truncated", truncated > self.limits.truncated_frac):
            cut = next(s for s in samples if s.finish_reason == "length")
            warnings.append(f"{truncated:.0%} of the responses of rollout {rollout_id} hit max_response_len "
                            f"({cut.response_length} tokens) before an eos: raise rollout.max_response_len, or "
                            "the model has not learned to stop (SFT with the eos)\n" + describe(cut))
        metrics = {"rollout/zero_std_group_frac": zero_std, "rollout/neg_logprob_mean": entropy}
        return metrics, warnings

    def after_eval(self, name: str, samples: list[Sample], score: float, constant_score: float,
                   reward_spec: str = "", step: int = 0) -> tuple[dict[str, float], list[str]]:
        """Metrics of how varied the eval's answers are; warnings when a set's evals score every sample
        alike (a reward that does not fit its answers: at the first eval, or for all 0 at the first two,
        since a starting model may be meant to score 0), when its score falls well below its best, or
        when the answers collapse onto one."""
        warnings = self._regression(name, score, step)
        rewards = {s.scored_reward() for s in samples}
        alike = len(rewards) == 1 and len(samples) > 1
        is_first = name not in self._first_share
        zero_since = None if is_first else self._zero_at_first.pop(name, None)
        if is_first and alike and score == 0:
            self._zero_at_first[name] = step  # said at the next eval if RL has not moved it
        elif alike and (is_first or zero_since is not None and score == 0):
            when = "at its first eval" if is_first else f"at its first eval (step {zero_since}) and again at step {step}"
            warnings.append(f"eval {name!r} scored {score} on every one of its {len(samples)} samples {when}, "
                            f"with the reward {reward_spec!r}: check that this reward reads the set's "
                            "answers as they are (eval.datasets[].reward; unset, it is rollout.reward), or the "
                            "model never answers right\n" + describe(samples[0]))
        counts = answer_counts(samples)
        top, top_count = counts.most_common(1)[0]
        share = top_count / len(samples)
        first = self._first_share.setdefault(name, share)
        entropy_fell = (self._first_entropy is not None and self._last_entropy is not None
                        and self._last_entropy < self.limits.collapse_entropy_ratio * self._first_entropy)
        collapsing = share >= self.limits.collapse_share and share - first >= self.limits.collapse_rise and entropy_fell
        if self._onset(f"collapse/{name}", collapsing):
            example = next(s for s in samples if s.response_text.strip() == top)
            warnings.append(f"eval {name!r} may be collapsing onto one answer: {share:.0%} of its responses are "
                            f"{top!r} (at the first eval {first:.0%}) while the sampling entropy fell from "
                            f"{self._first_entropy:.3f} to {self._last_entropy:.3f} per token. Score {score:.3f}; "
                            f"always giving the best constant answer scores {constant_score:.3f}. Lower the "
                            "learning rate, add entropy_coef or kl_loss_coef, or sample more per prompt\n"
                            + describe(example))
        return {f"eval/{name}/top_answer_share": share}, warnings

    def _regression(self, name: str, score: float, step: int) -> list[str]:
        best, best_step = self._best_eval.get(name, (score, step))
        if score >= best:
            best, best_step = score, step
        self._best_eval[name] = (best, best_step)
        if not self._onset(f"regression/{name}", best - score >= self.limits.regression_drop):
            return []
        return [f"eval {name!r} fell to {score:.3f} at step {step}, from its best {best:.3f} at step {best_step}: "
                "training is making the policy worse on this set. Lower train.lr (the usual cause) or raise "
                "algorithm.kl_loss_coef"]


def answer_counts(samples: list[Sample]) -> Counter:
    """How often each (stripped) response text was given."""
    return Counter(s.response_text.strip() for s in samples)
