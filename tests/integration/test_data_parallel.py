"""One optimizer step is the same whatever the layout: 1 or 2 ranks, big or small micro-batches.

The loss is normalised by the global token count and scaled back up by the world size before FSDP
averages gradients, so every layout must reach the same weights (up to float32 summation order).
"""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_config
from tether.trainer.batch import TrainBatch
from tether.cluster import plan_placement
from tether.config import config_from_dict
from tether.trainer.group import TrainerGroup

pytestmark = pytest.mark.integration


def rl_batch(rewards=(1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25), empty: tuple[int, ...] = ()) -> TrainBatch:
    """8 samples in 2 groups of 4 (each group one prompt), uneven lengths, with engine log-probs and rewards;
    ``empty``: samples with no response."""
    g = torch.Generator().manual_seed(0)
    tokens, prompt_lengths, response_lengths, logprobs = [], [], [], []
    prompts = [torch.randint(3, 60, (3 + k,), generator=g).tolist() for k in range(2)]
    for i in range(8):
        r = 0 if i in empty else 2 + (i * 5) % 4
        tokens.append(prompts[i // 4] + torch.randint(3, 60, (r,), generator=g).tolist())
        prompt_lengths.append(len(prompts[i // 4]))
        response_lengths.append(r)
        logprobs.append((-torch.rand(r, generator=g) * 3).tolist())
    return TrainBatch(tokens=tokens, prompt_lengths=prompt_lengths, response_lengths=response_lengths,
                      group_size=4, rewards=list(rewards), rollout_logprobs=logprobs, temperature=0.9,
                      sample_ids=[(i // 4, i % 4) for i in range(8)])


def weights_after_one_step(tmp_path, model_dir, data, num_train_actors: int, micro_batch_size: int,
                           algorithm: dict | None = None, token_budget: int | None = None, share: bool = False,
                           batch: TrainBatch | None = None):
    raw = tiny_config(model_dir, data, tmp_path, cluster={"num_train_actors": num_train_actors},
                      train={"lr": 1e-2, "micro_batch_size": micro_batch_size, "global_batch_size": 8,
                             "grad_clip": 0.0, "max_tokens_per_micro_batch": token_budget, "share_prompts": share},
                      rollout={"prompts_per_rollout": 2, "n_samples_per_prompt": 4}, algorithm=algorithm or {})
    cfg = config_from_dict(raw)
    placement = plan_placement(cfg.cluster)
    trainer = TrainerGroup(cfg, placement)
    try:
        trainer.init(total_steps=1, with_ref=cfg.algorithm.needs_ref_model, load_dir=None)
        metrics = trainer.train(0, ray.put(batch or rl_batch()))
        out = tmp_path / f"hf_{num_train_actors}_{micro_batch_size}_{token_budget}_{share}"
        trainer.save_hf(str(out))
    finally:
        trainer.shutdown()
        placement.remove()
    return load_file(str(out / "model.safetensors")), metrics


def test_layouts_reach_the_same_weights(ray_session, tiny_model_dir, addition_data, tmp_path):
    """One sample per row on one rank, against: smaller micro-batches, two ranks (strided), and two ranks
    each computing its group's prompt once (a group per rank; one sample per micro-batch)."""
    reference, ref_metrics = weights_after_one_step(tmp_path, tiny_model_dir, addition_data, 1, 8)
    for actors, micro, share in ((1, 2, False), (2, 4, True), (2, 1, True)):
        weights, metrics = weights_after_one_step(tmp_path, tiny_model_dir, addition_data, actors, micro, share=share)
        worst = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
        assert worst < 1e-5, (actors, micro, worst)
        # metrics are global sums too, so they agree across layouts
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), (key, actors, micro)
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    assert max(float((reference[k] - start[k]).abs().max()) for k in start) > 1e-4  # the step did move them


def test_sequence_level_terms_are_layout_independent_too(ray_session, tiny_model_dir, addition_data, tmp_path):
    """Per-sequence aggregation, a token-level estimator with KL in the reward (gathered across
    ranks), GSPO's sequence ratio, dual clip and the rollout correction: still one big batch."""
    algorithm = {"loss_agg_mode": "seq_mean_token_mean", "advantage_estimator": "reinforce_pp_baseline",
                 "kl_in_reward_coef": 0.1, "policy_loss": "gspo", "eps_clip_low": 0.05, "eps_clip_high": 0.05,
                 "dual_clip_c": 3.0, "rollout_correction": "token_clip"}
    reference, ref_metrics = weights_after_one_step(tmp_path, tiny_model_dir, addition_data, 1, 8, algorithm)
    # the reference and old log-prob passes run too: on two ranks, with each group's prompt computed once
    for actors, micro, share in ((1, 3, False), (2, 1, True)):
        weights, metrics = weights_after_one_step(tmp_path, tiny_model_dir, addition_data, actors, micro, algorithm,
                                                  share=share)
        worst = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
        # float32 summation order only: the gradients agree to 2e-8 (of 0.07 at most), but AdamW's first step
        # divides each by its own size, so the few parameters with gradients near 0 move by rounding-level
        # differences times lr 1e-2 (1.0e-5 with micro-batches of 3, 2.5e-5 with shared prompts on two ranks)
        assert worst < 5e-5, (actors, micro, worst)
        for key in ("train/loss", "train/pg_loss", "train/rollout_is_weight", "train/kl"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), (key, actors, micro)


def test_packed_micro_batches_on_ranks_balanced_by_tokens(ray_session, tiny_model_dir, addition_data, tmp_path):
    """Packing without padding, token-budget micro-batches and token-balanced ranks: same step."""
    reference, ref_metrics = weights_after_one_step(tmp_path, tiny_model_dir, addition_data, 1, 8)
    for actors, budget, share in ((1, 20, False), (2, 12, True)):
        weights, metrics = weights_after_one_step(tmp_path, tiny_model_dir, addition_data, actors, 8,
                                                  token_budget=budget, share=share)
        worst = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
        assert worst < 1e-5, (actors, budget, worst)
        assert metrics["train/loss"] == pytest.approx(ref_metrics["train/loss"], rel=1e-4, abs=1e-6)


def test_groups_without_signal_are_left_out_on_every_rank_alike(ray_session, tiny_model_dir, addition_data, tmp_path):
    """A group that scored alike and an empty response run on no rank (trainer/no_signal.py): the three
    samples left fall 2 + 1 on two ranks, whose micro-batch counts are evened out for FSDP."""
    batch = rl_batch(rewards=(1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0), empty=(3,))
    reference, ref_metrics = weights_after_one_step(tmp_path, tiny_model_dir, addition_data, 1, 8, batch=batch)
    assert ref_metrics["train/no_signal_frac"] == pytest.approx(5 / 8)
    for actors, micro, share in ((2, 1, False), (2, 1, True)):
        weights, metrics = weights_after_one_step(tmp_path, tiny_model_dir, addition_data, actors, micro,
                                                  share=share, batch=batch)
        worst = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
        assert worst < 1e-5, (actors, micro, share, worst)
        for key in ("train/loss", "train/entropy", "train/no_signal_frac"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), (key, actors, share)
