"""Segments of one trajectory (a generate function returning several samples for one, sharing its
sample index): the layout, group statistics over trajectories, and optimizer steps taking whole ones."""

from __future__ import annotations

import pytest
import torch

from tether.algorithms.advantages import AdvantageInputs, AdvantageParams, grpo_advantages
from tether.algorithms.losses import LossParams
from tether.config import config_from_dict
from tether.rollout.results import to_train_batch, trajectory_layout
from tether.sample import Sample
from tether.trainer.step import StepSettings, compute_advantages, optimizer_steps


def sample(k: int, j: int, reward: float, length: int = 2) -> Sample:
    return Sample(prompt_index=k, sample_index=j, prompt="p", label=None, metadata={}, prompt_ids=[1, 2],
                  response_ids=[3] * length, response_logprobs=[-0.5] * length, reward=reward, finish_reason="stop",
                  status="completed")


@pytest.fixture()
def cfg(tmp_path):
    return config_from_dict({"model": {"path": str(tmp_path)}, "rollout": {"n_samples_per_prompt": 2}})


def test_samples_sharing_a_sample_index_are_one_trajectorys_segments(cfg):
    # Prompt 0: trajectory 0 in two segments, trajectory 1 in one; prompt 1: one and three.
    groups = [[sample(0, 0, 1.0), sample(0, 0, 1.0), sample(0, 1, 0.0)],
              [sample(1, 0, 0.5), sample(1, 1, 0.0), sample(1, 1, 0.0), sample(1, 1, 0.0)]]
    assert trajectory_layout(groups, cfg) == (2, [0, 0, 1, 2, 3, 3, 3])
    plain = [[sample(0, 0, 1.0), sample(0, 1, 0.0)], [sample(1, 0, 1.0), sample(1, 1, 0.0)]]
    assert trajectory_layout(plain, cfg) == (2, None)  # every sample its own trajectory: as before
    with pytest.raises(ValueError, match=r"groups of \[1, 2\] trajectories"):
        trajectory_layout([[sample(0, 0, 1.0), sample(0, 0, 1.0)], plain[1]], cfg)
    with pytest.raises(ValueError, match=r"segments of trajectory sample_index=0 of group 0 are not adjacent"):
        trajectory_layout([[sample(0, 0, 1.0), sample(0, 1, 0.0), sample(0, 0, 1.0)]], cfg)
    with pytest.raises(ValueError, match=r"groups of \[2, 3\] samples"):
        trajectory_layout([plain[0], plain[1] + [sample(1, 2, 0.0)]], cfg)


def settings(estimator: str = "grpo", gbs: int = 2) -> StepSettings:
    return StepSettings(micro_batch_size=2, global_batch_size=gbs, pad_id=0, grad_clip=1.0, policy_loss="ppo_clip",
                        loss_params=LossParams(), advantage_estimator=estimator)


def test_a_trajectorys_segments_share_its_advantage_from_trajectory_statistics(cfg):
    groups = [[sample(0, 0, 1.0), sample(0, 0, 1.0, 3), sample(0, 1, 0.0)],
              [sample(1, 0, 0.5), sample(1, 1, 0.0), sample(1, 1, 0.0), sample(1, 1, 0.0, 4)]]
    size, trajectories = trajectory_layout(groups, cfg)
    batch = to_train_batch([s for g in groups for s in g], size, 1.0, trajectories)
    batch.validate()
    advantages, returns, _ = compute_advantages(batch, settings(), None, None)
    # GRPO over the four trajectories' rewards, [1, 0] and [0.5, 0], as if each were one sample.
    expected = grpo_advantages(AdvantageInputs(torch.tensor([1.0, 0.0, 0.5, 0.0]), torch.ones(4, 1), 2),
                               AdvantageParams())[0].advantages[:, 0]
    for i, t in enumerate(trajectories):
        assert torch.allclose(advantages[i], expected[t].expand(batch.response_lengths[i]))
    assert returns is None
    with pytest.raises(ValueError, match=r"'reinforce_pp' works per token; .* needs an outcome estimator"):
        compute_advantages(batch, settings("reinforce_pp"), None, None)


def test_a_trajectory_whose_segments_all_failed_counts_in_no_statistic(cfg):
    groups = [[sample(0, 0, 1.0), sample(0, 0, 1.0), sample(0, 1, 0.0), sample(0, 2, 0.0)]]
    for s in groups[0][2:3]:
        s.fail("tool", "gone")
    cfg3 = config_from_dict({**cfg.model_dump(mode="json"), "rollout": {"n_samples_per_prompt": 3}})
    size, trajectories = trajectory_layout(groups, cfg3)
    batch = to_train_batch(groups[0], size, 1.0, trajectories)
    advantages, _, _ = compute_advantages(batch, settings(), None, None)
    # Trajectories 0 (reward 1) and 2 (reward 0) count: mean 0.5, std 0.5 -> +1 and -1; trajectory 1 gets 0.
    assert [round(float(advantages[i][0]), 4) for i in range(4)] == [1.0, 1.0, 0.0, -1.0]


def test_an_optimizer_step_takes_whole_trajectories():
    groups = [[sample(0, 0, 1.0), sample(0, 0, 1.0), sample(0, 1, 0.0)],
              [sample(1, 0, 0.5), sample(1, 1, 0.0), sample(1, 1, 0.0), sample(1, 1, 0.0)]]
    batch = to_train_batch([s for g in groups for s in g], 2, 1.0, [0, 0, 1, 2, 3, 3, 3])
    assert optimizer_steps(batch, 2) == [[0, 1, 2], [3, 4, 5, 6]]
    assert optimizer_steps(batch, 4) == [[0, 1, 2, 3, 4, 5, 6]]
    with pytest.raises(ValueError, match="batch of 4 trajectories is not a multiple of global_batch_size=3"):
        optimizer_steps(batch, 3)
    plain = to_train_batch([sample(0, j, 1.0) for j in range(4)], 2, 1.0)
    assert optimizer_steps(plain, 2) == [[0, 1], [2, 3]]
