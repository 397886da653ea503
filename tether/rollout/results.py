"""A rollout's groups as the trainer takes them (the TrainBatch) and as the logs show them (metrics)."""

from __future__ import annotations

import statistics

from tether.config import TetherConfig
from tether.sample import RETRIES, Sample, counted
from tether.trainer.batch import TrainBatch


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    """Rewards over the samples that did not fail (a failed one has none); lengths over all."""
    rewards = [s.scored_reward() for s in counted(samples)]
    lengths = [s.response_length for s in samples]
    metrics = {
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "rollout/reward_std": statistics.pstdev(rewards) if rewards else float("nan"),
        "rollout/response_len_mean": statistics.fmean(lengths),
        "rollout/response_len_max": float(max(lengths)),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/samples": float(len(samples)),
    }
    parts = sorted({k for s in samples if s.reward_info for k in s.reward_info})
    for key in parts:  # every entry of dict rewards, not only the one trained on
        metrics[f"rollout/reward/{key}_mean"] = statistics.fmean(
            s.reward_info[key] for s in samples if s.reward_info and key in s.reward_info)
    metrics.update(sample_metrics(samples, "rollout/sample"))
    return metrics


def sample_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """The mean of each number generate functions recorded in `Sample.metrics`, over the samples that
    have it (a tool-call count, turns per sample); retry counts go to failures/retried/<kind>."""
    names = sorted({k for s in samples for k in s.metrics if not k.startswith(RETRIES)})
    return {f"{prefix}/{k}_mean": statistics.fmean(float(s.metrics[k]) for s in samples if k in s.metrics)
            for k in names}


def to_train_batch(samples: list[Sample], group_size: int, temperature: float,
                   trajectories: list[int] | None = None) -> TrainBatch:
    """``group_size``: trajectories per group; ``trajectories``: each sample's (trajectory_layout), None
    when every sample is a trajectory of its own."""
    return TrainBatch(
        tokens=[s.prompt_ids + s.response_ids for s in samples],
        prompt_lengths=[len(s.prompt_ids) for s in samples],
        response_lengths=[s.response_length for s in samples],
        group_size=group_size,
        # A failed sample has no reward: excluded below, its place holder is never read.
        rewards=[0.0 if s.failed else s.scored_reward() for s in samples],
        rollout_logprobs=[list(s.response_logprobs) for s in samples],
        temperature=temperature,
        sample_ids=[(s.prompt_index, s.sample_index) for s in samples],
        # Only when some token is masked: a batch without inserted tokens travels as before. A removed
        # sample keeps its place (groups keep their shape) with nothing of it trained on.
        loss_masks=[[0] * s.response_length if s.remove else s.response_loss_mask() for s in samples]
        if any(s.loss_mask is not None or s.remove for s in samples) else None,
        excluded=[s.remove for s in samples] if any(s.remove for s in samples) else None,
        trajectories=trajectories,
        # A failed sample's place holder is never read (it is excluded).
        teacher_logprobs=[s.teacher_logprobs if s.teacher_logprobs is not None else [0.0] * s.response_length
                          for s in samples] if any(s.teacher_logprobs is not None for s in samples) else None,
    )


def trajectory_layout(groups: list[list[Sample]], cfg: TetherConfig) -> tuple[int, list[int] | None]:
    """(trajectories per group, each sample's trajectory in the batch, or None when every sample is one).

    A generate function may return several samples for one: with new sample indices they are more
    samples of the group (every group must then have as many); sharing the sample index they came
    from, they are segments of one trajectory (a sub-agent's run, a compacted context), any number
    per trajectory: the trajectory is what group statistics count, and its segments stay together."""
    keys = [[s.sample_index for s in g] for g in groups]
    if all(len(set(k)) == len(k) for k in keys):
        sizes = sorted({len(g) for g in groups})
        if len(sizes) > 1:
            raise ValueError(f"groups of {sizes} samples in one rollout: every group must have the same size for "
                             "group advantages (a generate function returned a varying number of samples; "
                             "segments of one trajectory keep the sample_index they came from)")
        return (sizes[0] if sizes else cfg.rollout.n_samples_per_prompt), None
    counts = sorted({len(set(k)) for k in keys})
    if len(counts) > 1:
        raise ValueError(f"groups of {counts} trajectories in one rollout: every group must have the same number")
    trajectories: list[int] = []
    base = 0
    for g, group_keys in enumerate(keys):
        order: dict[int, int] = {}
        for j, key in enumerate(group_keys):
            if key in order and group_keys[j - 1] != key:
                raise ValueError(f"the segments of trajectory sample_index={key} of group {g} are not adjacent: a "
                                 "generate function returns a trajectory's segments one after another")
            order.setdefault(key, len(order))
            trajectories.append(base + order[key])
        base += len(order)
    return counts[0], trajectories
