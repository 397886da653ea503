"""Eval sets: their samples, scores, pass@k and per-prompt pass rates, and the constant-answer baseline."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace
from math import comb

from tether.config import EvalDatasetConfig
from tether.engine.sampling import SamplingParams
from tether.rewards.scorer import Scorer
from tether.rollout.data_source import PromptRow
from tether.rollout.health import answer_counts
from tether.rollout.results import sample_metrics
from tether.errors import RolloutFailed
from tether.sample import Sample, counted


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with ``c`` passing responses among ``n`` (Chen et al., 2021):
    the chance that k responses drawn without replacement from the n include a passing one,
    1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def reported_ks(n: int) -> list[int]:
    """Every k up to 8; beyond, the powers of two and n itself (pass@1..n of n=64 would flood the logs)."""
    if n <= 8:
        return list(range(1, n + 1))
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n})


def prompt_pass_rates(samples: list[Sample], n: int, threshold: float) -> list[dict]:
    """One row per prompt: how many of its n responses passed, and its mean reward (over the responses
    that did not fail; a prompt whose every response failed has no row)."""
    rows = []
    for k in range(0, len(samples), n):
        group = counted(samples[k:k + n])
        if not group:
            continue
        passed = sum(s.scored_reward() >= threshold for s in group)
        rows.append({"prompt_index": group[0].prompt_index, "prompt": group[0].prompt, "label": group[0].label,
                     "n": len(group), "passed": passed, "pass_rate": passed / len(group),
                     "mean_reward": statistics.fmean(s.scored_reward() for s in group)})
    return rows


def pass_metrics(rows: list[dict], n: int, name: str) -> dict[str, float]:
    """eval/<name>/pass@k for every reported k (mean over prompts), from the per-prompt counts."""
    if n < 2:
        return {}
    # A prompt that lost responses to failures has fewer than n: it counts for the k it still covers.
    return {f"eval/{name}/pass@{k}": statistics.fmean(pass_at_k(r["n"], r["passed"], k) for r in rows if r["n"] >= k)
            for k in reported_ks(n) if any(r["n"] >= k for r in rows)}


class EvalSet:
    """One named eval dataset with its own sampling settings and reward."""

    def __init__(self, cfg: EvalDatasetConfig, rows: list[PromptRow], scorer: Scorer):
        if cfg.name is None:  # the config names every set (a reasoning_gym per_task set by its task)
            raise ValueError("an eval set without a name reached the rollout manager")
        self.cfg, self.name = cfg, cfg.name
        self.rows = rows
        self.scorer = scorer
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                     max_new_tokens=cfg.max_response_len)
        self._constant_scores: dict[str, float] = {}

    def constant_answer_score(self, samples: list[Sample], answers: Counter) -> float:
        """The best score one fixed answer given to every prompt would get: what a run that collapsed
        onto a single answer scores. Tried: the model's 3 most common answers and the 3 most common
        labels (each scored once per eval set, then cached)."""
        labels = Counter(str(s.label) for s in samples if s.label is not None)
        candidates = list(dict.fromkeys([a for a, _ in answers.most_common(3)] + [a for a, _ in labels.most_common(3)]))
        for answer in candidates:
            if answer not in self._constant_scores:
                copies = [replace(s, response_text=answer, metadata=dict(s.metadata), metrics={}) for s in samples]
                scores = [x for x in self.scorer.score(copies, self.cfg.n_samples_per_prompt) if x is not None]
                self._constant_scores[answer] = statistics.fmean(scores) if scores else 0.0
        return max(self._constant_scores[a] for a in candidates)

    def groups(self) -> list[list[Sample]]:
        return [[Sample(prompt_index=r.index, sample_index=j, prompt=r.prompt, label=r.label,
                        metadata=dict(r.metadata), prompt_ids=list(r.prompt_ids), group_index=k)
                 for j in range(self.cfg.n_samples_per_prompt)]
                for k, r in enumerate(self.rows)]

    def summarize(self, groups: list[list[Sample]], extra: dict[str, float]) -> tuple[dict, list[Sample], list[dict], Counter]:
        """An eval's metrics under eval/<name>/ (``extra``: the rollout function's own), its samples, the
        per-prompt pass rates and the answer counts. Scores are over the samples that did not fail
        (``eval/<name>/failed`` counts the others); an eval whose every sample failed raises."""
        name = self.name
        samples = [s for group in groups for s in group]
        scored = counted(samples)
        if not scored:
            first = samples[0].failure or {}
            raise RolloutFailed(f"eval {name}: every one of its {len(samples)} samples failed, e.g. {samples[0].describe()}: "
                                f"{first.get('kind')}: {first.get('error', '')[:400]}")
        n = len(groups[0])
        metrics: dict = {key if key.startswith(f"eval/{name}/") else f"eval/{name}/{key}": value
                         for key, value in extra.items() if not key.startswith("failures/")}
        metrics[f"eval/{name}/failed"] = float(len(samples) - len(scored))
        metrics[f"eval/{name}/score"] = statistics.fmean(s.scored_reward() for s in scored)
        metrics[f"eval/{name}/response_len_mean"] = statistics.fmean(s.response_length for s in samples)
        metrics.update(sample_metrics(samples, f"eval/{name}"))
        prompts = prompt_pass_rates(samples, n, self.cfg.pass_threshold)
        metrics.update(pass_metrics(prompts, n, name))
        answers = answer_counts(scored)
        metrics[f"eval/{name}/constant_answer_score"] = self.constant_answer_score(scored, answers)
        return metrics, samples, prompts, answers
