"""The loss mask: tokens with mask 0 (a tool's output) are in the input but never trained on, counted
in no normaliser and in no metric, in every aggregation mode, padded or packed."""

from __future__ import annotations

import pytest
import torch

from tether.algorithms.advantages import AdvantageParams
from tether.algorithms.aggregation import AGGREGATIONS
from tether.algorithms.losses import LossParams
from tether.trainer.batch import TrainBatch, collate, collate_packed
from tether.rollout.results import to_train_batch
from tether.sample import Sample
from tether.models.tiny import build_char_tokenizer, build_tiny_model
from tether.trainer.critic import Critic, load_value_model
from tether.models.hf import load_model
from tether.trainer.step import StepSettings, compute_advantages, train_on_batch

SHAPES = [(3, 9), (5, 1), (2, 14), (4, 0), (6, 5), (3, 3), (2, 20), (4, 7)]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]
TAILS = {1: 4, 3: 3, 6: 5, 7: 2}  # sample -> masked tokens appended to its response (3: all masked)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), build_char_tokenizer(), hidden_size=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=64, max_positions=128)


def batches() -> tuple[TrainBatch, TrainBatch]:
    """The same rollout twice: as generated, and with extra masked tokens after some responses."""
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, 60, (p + r,), generator=g).tolist() for p, r in SHAPES]
    logprobs = [(-torch.rand(r, generator=g)).tolist() for _, r in SHAPES]
    plain = TrainBatch(tokens=tokens, prompt_lengths=[p for p, _ in SHAPES], response_lengths=[r for _, r in SHAPES],
                       group_size=4, rewards=REWARDS, rollout_logprobs=logprobs, temperature=0.8)
    tails = {i: torch.randint(3, 60, (n,), generator=g).tolist() for i, n in TAILS.items()}
    masked = TrainBatch(
        tokens=[t + tails.get(i, []) for i, t in enumerate(tokens)], prompt_lengths=plain.prompt_lengths,
        response_lengths=[r + TAILS.get(i, 0) for i, (_, r) in enumerate(SHAPES)], group_size=4, rewards=REWARDS,
        # The inserted tokens' "engine log-probs" are far off: a metric that counted them would show it.
        rollout_logprobs=[lp + [-50.0] * TAILS.get(i, 0) for i, lp in enumerate(logprobs)], temperature=0.8,
        loss_masks=[[1] * r + [0] * TAILS.get(i, 0) for i, (_, r) in enumerate(SHAPES)])
    return plain, masked


def settings(**kw) -> StepSettings:
    return StepSettings(**{"micro_batch_size": 3, "global_batch_size": 8, "pad_id": 0, "grad_clip": 0.0,
                           "policy_loss": "ppo_clip", "loss_params": LossParams(entropy_coef=0.01),
                           "advantage_estimator": "grpo", "max_response_len": 25, **kw})


def step(model_dir, batch: TrainBatch, s: StepSettings):
    torch.manual_seed(0)
    model = load_model(str(model_dir), "float32")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = train_on_batch(model, optimizer, scheduler, batch, s, 0, 1)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), metrics


@pytest.mark.parametrize("packing", [None, 30])
@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp"])
def test_masked_tokens_change_nothing_that_is_trained(model_dir, agg, packing, estimator):
    # Masked tokens at the end of a response are invisible to every earlier position (causal
    # attention), so training on them masked must equal training on the responses without them.
    plain, masked = batches()
    s = settings(loss_agg_mode=agg, max_tokens_per_micro_batch=packing, advantage_estimator=estimator)
    (w_plain, m_plain), (w_masked, m_masked) = step(model_dir, plain, s), step(model_dir, masked, s)
    assert float((w_plain - w_masked).abs().max()) < 1e-5
    for key in ("train/loss", "train/pg_loss", "train/entropy", "mismatch/logprob_abs_diff_mean",
                "mismatch/logprob_abs_diff_max"):
        assert m_masked[key] == pytest.approx(m_plain[key], abs=1e-5), key
    # And the mask does something: the same batch trained on every token reaches other weights.
    unmasked = masked.select(list(range(8)))
    unmasked.loss_masks = None
    assert float((step(model_dir, unmasked, s)[0] - w_masked).abs().max()) > 1e-4


def critic_for(model_dir) -> Critic:
    """The trainer's critic without FSDP, its head random so that every value counts (a zero head
    would hide a masked token's value leaking into GAE)."""
    critic = Critic.__new__(Critic)
    critic.model = load_value_model(str(model_dir), "float32")
    torch.nn.init.normal_(critic.model.score.weight, std=0.5, generator=torch.Generator().manual_seed(1))
    critic.optimizer = torch.optim.SGD(critic.model.parameters(), lr=0.1)
    critic.scheduler = torch.optim.lr_scheduler.LambdaLR(critic.optimizer, lambda _: 1.0)
    critic.value_clip, critic.grad_clip = 0.2, 0.0
    return critic


@pytest.mark.parametrize("packing", [None, 30])
def test_gae_with_a_critic_ignores_masked_tokens(model_dir, packing):
    # PPO with GAE: the critic's values on masked tokens feed no advantage and no return, and the
    # value loss skips them, so policy and critic reach the weights they reach without those tokens.
    s = settings(advantage_estimator="gae", advantage_params=AdvantageParams(gamma=0.9, lam=0.8),
                 max_tokens_per_micro_batch=packing)

    def run(batch):
        torch.manual_seed(0)
        model, critic = load_model(str(model_dir), "float32"), critic_for(model_dir)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        metrics = train_on_batch(model, optimizer, scheduler, batch, s, 0, 1, critic=critic)
        vec = torch.nn.utils.parameters_to_vector
        return vec(model.parameters()).detach(), vec(critic.model.parameters()).detach(), metrics

    plain, masked = batches()
    (p_plain, c_plain, m_plain), (p_masked, c_masked, m_masked) = run(plain), run(masked)
    assert float((p_plain - p_masked).abs().max()) < 1e-5 and float((c_plain - c_masked).abs().max()) < 1e-5
    for key in ("train/loss", "train/critic/value_loss", "train/adv_value_mean", "train/adv_return_mean"):
        assert m_masked[key] == pytest.approx(m_plain[key], abs=1e-5), key
    assert m_plain["train/adv_value_mean"] != 0.0  # the random head gives real values
    unmasked = masked.select(list(range(8)))
    unmasked.loss_masks = None
    p_all, c_all, _ = run(unmasked)
    assert float((c_all - c_masked).abs().max()) > 1e-4 and float((p_all - p_masked).abs().max()) > 1e-4


@pytest.mark.parametrize("estimator", ["reinforce_pp", "gae"])
def test_token_level_returns_skip_masked_tokens(estimator):
    # A tool's output in the middle of a response: returns flow from one policy token to the next
    # and the outcome reward sits on the last policy token, as if the tool's tokens were not there.
    # GAE bootstraps from the next policy token's value, never from a masked token's.
    s = settings(advantage_estimator=estimator, advantage_params=AdvantageParams(gamma=0.9, lam=0.7))
    masks = [[1, 1, 0, 0, 1], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    masked = TrainBatch(tokens=[[1] * 7] * 4, prompt_lengths=[2] * 4, response_lengths=[5] * 4, group_size=2,
                        rewards=[1.0, 0.0, 1.0, 0.5], loss_masks=masks)
    kept = [sum(m) for m in masks]
    compact = TrainBatch(tokens=[[1] * (2 + k) for k in kept], prompt_lengths=[2] * 4, response_lengths=kept,
                         group_size=2, rewards=[1.0, 0.0, 1.0, 0.5])
    keeps = [torch.tensor(m, dtype=torch.bool) for m in masks]
    values = {i: torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(4)} if estimator == "gae" else None
    full, full_returns, _ = compute_advantages(masked, s, {}, None, values)
    short, short_returns, _ = compute_advantages(compact, s, {}, None,
                                                 values and {i: v[keeps[i]] for i, v in values.items()})
    for i, keep in enumerate(keeps):
        assert torch.allclose(full[i][keep], short[i]) and not full[i][~keep].any(), i
        if values is not None:
            assert torch.allclose(full_returns[i][keep], short_returns[i]) and not full_returns[i][~keep].any(), i
    assert short[0][-1] != 0  # the reward reached the last policy token


def test_micro_batches_carry_the_mask_padded_and_packed():
    _, masked = batches()
    for mb in (collate(masked, [1, 6], 0), collate_packed(masked, [1, 6], 0)):
        assert mb.num_tokens == 1 + 20
        for (row, start), i in zip(mb.spans, mb.indices):
            r = masked.response_lengths[i]
            assert mb.response_mask[row, start : start + r].tolist() == masked.loss_masks[i]


def test_a_wrong_mask_names_the_sample():
    _, masked = batches()
    masked.loss_masks[2] = [1] * 3
    with pytest.raises(ValueError, match="TrainBatch sample 2: its loss mask must be 14 values of 0 or 1"):
        masked.validate()
    masked.loss_masks[2] = [2] * 14
    with pytest.raises(ValueError, match="sample 2"):
        masked.validate()


def test_samples_bring_their_masks_into_the_batch():
    def sample(mask):
        return Sample(0, 0, "p", None, {}, [5, 6], response_ids=[7, 8, 9], response_logprobs=[-1.0] * 3, reward=1.0,
                      loss_mask=mask)

    assert to_train_batch([sample(None), sample(None)], 2, 1.0).loss_masks is None
    batch = to_train_batch([sample([1, 0, 1]), sample(None)], 2, 1.0)
    assert batch.loss_masks == [[1, 0, 1], [1, 1, 1]] and batch.trained_tokens(0) == 2
    assert sample([1, 0, 1]).to_dict()["loss_mask"] == [1, 0, 1]


def test_a_removed_sample_keeps_its_place_with_nothing_trained():
    samples = [Sample(0, j, "p", None, {}, [5, 6], response_ids=[7, 8], response_logprobs=[-1.0] * 2, reward=1.0)
               for j in range(2)]
    samples[1].remove = True
    batch = to_train_batch(samples, 2, 1.0)
    assert len(batch) == 2 and batch.loss_masks == [[1, 1], [0, 0]] and batch.trained_tokens(1) == 0
    # ... and out of its group's statistics: excluded, which the batch checks against its mask.
    assert batch.excluded == [False, True] and batch.select([1]).excluded == [True]
    batch.validate()
    assert to_train_batch(samples[:1], 1, 1.0).excluded is None
    batch.loss_masks = None
    with pytest.raises(ValueError, match="sample 1 is excluded but 2 of its tokens"):
        batch.validate()
