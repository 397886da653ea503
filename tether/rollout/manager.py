"""The rollout manager: a Ray actor owning prompt data, engines, rewards and eval.

``generate(rollout_id)`` draws the next prompts, samples n responses for each on the engines, scores
them, and returns the TrainBatch (which stays in the object store: the driver passes the reference
on to the trainer) together with a small dict of metrics.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from tether.batch import TrainBatch
from tether.config import EvalDatasetConfig, TetherConfig, config_from_dict
from tether.engine.sampling import SamplingParams
from tether.rewards import compute_rewards, load_reward_fn
from tether.rewards.shaping import apply_overlong_penalty
from tether.rollout.data_source import DataSource, PromptRow, load_prompt_rows
from tether.rollout.prompt_format import ROUND_TRIP_ROWS, PromptFormat, round_trip_problems
from tether.rollout.fleet import EngineFleet
from tether.rollout.health import RolloutHealth, answer_counts
from tether.sample import Sample
from tether.trainer.model import load_tokenizer

DATA_STATE = "data_source.json"


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    rewards = [float(s.reward) for s in samples]
    lengths = [s.response_length for s in samples]
    return {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/response_len_mean": statistics.fmean(lengths),
        "rollout/response_len_max": float(max(lengths)),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/samples": float(len(samples)),
    }


def to_train_batch(samples: list[Sample], group_size: int, temperature: float) -> TrainBatch:
    return TrainBatch(
        tokens=[s.prompt_ids + s.response_ids for s in samples],
        prompt_lengths=[len(s.prompt_ids) for s in samples],
        response_lengths=[s.response_length for s in samples],
        group_size=group_size,
        rewards=[float(s.reward) for s in samples],
        rollout_logprobs=[list(s.response_logprobs) for s in samples],
        temperature=temperature,
        sample_ids=[(s.prompt_index, s.sample_index) for s in samples],
        # Only when some token is masked: a batch without inserted tokens travels as before. A removed
        # sample keeps its place (groups keep their shape) with nothing of it trained on.
        loss_masks=[[0] * s.response_length if s.remove else s.response_loss_mask() for s in samples]
        if any(s.loss_mask is not None or s.remove for s in samples) else None,
    )


class EvalSet:
    """One named eval dataset with its own sampling settings and reward."""

    def __init__(self, cfg: EvalDatasetConfig, rows: list[PromptRow], reward_spec: str):
        self.cfg = cfg
        self.rows = rows
        self.reward_spec = reward_spec
        self.reward_fn = load_reward_fn(reward_spec)
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
                copies = [replace(s, response_text=answer, metadata=dict(s.metadata)) for s in samples]
                self._constant_scores[answer] = statistics.fmean(
                    compute_rewards(self.reward_fn, copies, self.reward_spec))
        return max(self._constant_scores[a] for a in candidates)

    def samples(self) -> list[Sample]:
        return [
            Sample(prompt_index=r.index, sample_index=j, prompt=r.prompt, label=r.label,
                   metadata=dict(r.metadata), prompt_ids=list(r.prompt_ids), group_index=k)
            for k, r in enumerate(self.rows) for j in range(self.cfg.n_samples_per_prompt)
        ]


class RolloutManager:
    def __init__(self, cfg_dict: dict, engine_urls: list[str]):
        self.cfg: TetherConfig = config_from_dict(cfg_dict, "rollout manager")
        d, r = self.cfg.data, self.cfg.rollout
        self.tokenizer = load_tokenizer(self.cfg.model.path)
        keys = dict(prompt_key=d.prompt_key, label_key=d.label_key, metadata_key=d.metadata_key,
                    fmt=PromptFormat.from_config(d), max_prompt_len=d.max_prompt_len)
        # Without prompt data the manager only evaluates (`tether eval`, the eval at the end of `tether sft`).
        self.data: DataSource | None = None
        self.filtered = 0
        if d.path is not None:
            rows, self.filtered = load_prompt_rows(d.path, self.tokenizer, **keys)
            self.data = DataSource(rows, prompts_per_rollout=r.prompts_per_rollout,
                                   n_samples_per_prompt=r.n_samples_per_prompt, shuffle=d.shuffle, seed=self.cfg.seed)
        self.reward_fn = load_reward_fn(r.reward)
        self.params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                     max_new_tokens=r.max_response_len, stop_token_ids=tuple(r.stop_token_ids))
        self.fleet = EngineFleet(engine_urls, self.cfg.cluster.call_timeout_s)
        self.eval_sets = [EvalSet(e, load_prompt_rows(e.path, self.tokenizer, **keys)[0], e.reward or r.reward)
                          for e in self.cfg.eval.datasets]
        self.samples_dir = Path(self.cfg.output_dir) / "rollouts"
        self.health = RolloutHealth(r.n_samples_per_prompt)

    def num_rollout_per_epoch(self) -> int:
        return self._require_data().num_rollout_per_epoch

    def _require_data(self) -> DataSource:
        if self.data is None:
            raise ValueError("data.path is required for RL training (a JSONL file of prompts)")
        return self.data

    def data_info(self) -> dict:
        return {"train_rows": len(self.data.rows) if self.data else 0, "filtered_long_prompts": self.filtered,
                "eval_rows": {e.cfg.name: len(e.rows) for e in self.eval_sets}, "warnings": self._check_text()}

    def _check_text(self) -> list[str]:
        """Warnings for prompts and labels that the tokenizer does not give back as they are."""
        sets = [(e.cfg.path, e.rows) for e in self.eval_sets]
        if self.data is not None:
            sets.insert(0, (self.cfg.data.path, self.data.rows))
        items = [(f"{path}:{row.line}", what, text) for path, rows in sets
                 for row in rows[:ROUND_TRIP_ROWS]
                 for what, text in (("prompt", row.text), ("label", row.label)) if isinstance(text, str)]
        return round_trip_problems(self.tokenizer, items)

    def generate(self, rollout_id: int) -> tuple[TrainBatch, dict[str, float]]:
        """Samples for one rollout, scored. Called with num_returns=2: the batch stays in the object store."""
        r = self.cfg.rollout
        data = self._require_data()
        epoch = data.epoch
        samples = data.next_samples()
        for s in samples:
            s.rollout_id = rollout_id
        metrics = self.fleet.generate(samples, self.params, r.n_samples_per_prompt, self._seed(rollout_id, 0),
                                      f"rollout {rollout_id}")
        start = time.perf_counter()
        compute_rewards(self.reward_fn, samples, r.reward)
        if r.overlong_buffer_len is not None:
            metrics["rollout/overlong_penalty_mean"] = apply_overlong_penalty(
                samples, r.max_response_len, r.overlong_buffer_len, r.overlong_penalty_factor)
        metrics["timing/reward_s"] = time.perf_counter() - start
        metrics.update(rollout_metrics(samples))
        health, metrics["warnings"] = self.health.after_rollout(rollout_id, samples)
        metrics.update(health)
        metrics["rollout/epoch"] = float(epoch)
        self._dump(samples, f"rollout_{rollout_id:06d}.jsonl")
        return to_train_batch(samples, r.n_samples_per_prompt, r.temperature), metrics

    def eval(self, rollout_id: int) -> dict:
        """Scores of every eval set (and "warnings", a list of texts, when one looks collapsed)."""
        metrics: dict = {"warnings": []}
        start = time.perf_counter()
        for k, eval_set in enumerate(self.eval_sets):
            name = eval_set.cfg.name
            samples = eval_set.samples()
            for s in samples:
                s.rollout_id = rollout_id
            self.fleet.generate(samples, eval_set.params, eval_set.cfg.n_samples_per_prompt,
                                self._seed(rollout_id, k + 1), f"eval {name} at rollout {rollout_id}")
            rewards = compute_rewards(eval_set.reward_fn, samples, eval_set.reward_spec)
            score = metrics[f"eval/{name}/score"] = statistics.fmean(rewards)
            metrics[f"eval/{name}/response_len_mean"] = statistics.fmean(s.response_length for s in samples)
            answers = answer_counts(samples)
            constant = metrics[f"eval/{name}/constant_answer_score"] = eval_set.constant_answer_score(samples, answers)
            health, warnings = self.health.after_eval(name, samples, score, constant, eval_set.reward_spec,
                                                     rollout_id)
            metrics.update(health)
            metrics["warnings"] += warnings
            self._dump(samples, f"eval_{name}_{rollout_id:06d}.jsonl")
            self._dump_answers(samples, answers, f"eval_{name}_{rollout_id:06d}_answers.json")
        metrics["timing/eval_s"] = time.perf_counter() - start
        return metrics

    def _seed(self, rollout_id: int, stream: int) -> int:
        # Independent of call order: a resumed run samples rollout k exactly as an uninterrupted one.
        return (self.cfg.seed * 1_000_003 + rollout_id) * 17 + stream

    def _dump(self, samples: list[Sample], name: str) -> None:
        self.samples_dir.mkdir(parents=True, exist_ok=True)
        with open(self.samples_dir / name, "w") as f:
            for s in samples:
                f.write(json.dumps(s.to_dict()) + "\n")

    def _dump_answers(self, samples: list[Sample], answers: Counter, name: str) -> None:
        """Per-answer counts and mean rewards of one eval, most common first."""
        rewards: dict[str, list[float]] = {}
        for s in samples:
            rewards.setdefault(s.response_text.strip(), []).append(float(s.reward))
        rows = [{"answer": a, "count": c, "mean_reward": statistics.fmean(rewards[a])} for a, c in answers.most_common()]
        (self.samples_dir / name).write_text(json.dumps(rows, indent=1) + "\n")

    # ------------------------------------------------------------ state and memory
    def save_state(self, ckpt_dir: str) -> None:
        (Path(ckpt_dir) / DATA_STATE).write_text(json.dumps(self._require_data().state_dict()))

    def load_state(self, ckpt_dir: str) -> dict:
        state = json.loads((Path(ckpt_dir) / DATA_STATE).read_text())
        self._require_data().load_state_dict(state)
        return state

    def release_memory(self, tags: list[str]) -> None:
        self.fleet.release_memory(tags)

    def resume_memory(self, tags: list[str]) -> None:
        self.fleet.resume_memory(tags)

    def engine_health(self) -> dict[str, bool]:
        return self.fleet.health()
