"""A group's prompt computed once (trainer/shared_prefix.py): the units a batch is laid out in, and
log-probs, losses and gradients equal to the unshared layouts' on every family the trainer supports,
with LoRA, either LM head, both CPU attention implementations, and multi-turn samples."""

from __future__ import annotations

import pytest
import torch
import transformers

from tether.algorithms.losses import LossParams
from tether.config.tree import LoRAConfig
from tether.models.lora import apply_lora
from tether.trainer import shared_prefix
from tether.trainer.batch import TrainBatch, collate
from tether.trainer.shared_prefix import Unit, collate_shared, common_prefix, plan_units, split_to
from tether.trainer.step import StepSettings, assign_ranks, micro_batches, response_logprobs, train_on_batch

SMALL = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
}


def tiny(family: str, attention: str = "sdpa") -> transformers.PreTrainedModel:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**SMALL, **extra, tie_word_embeddings=True)
    model = getattr(transformers, model_cls)(config).float()
    model.set_attn_implementation(attention)
    return model


def grouped_batch(prompts=(7, 4, 11), responses=(5, 0, 9, 2), seed: int = 0, vocab: int = 300) -> TrainBatch:
    """Groups of len(responses) samples sharing a prompt; one empty response per group."""
    g = torch.Generator().manual_seed(seed)
    tokens, prompt_lengths, response_lengths, ids = [], [], [], []
    for group, p in enumerate(prompts):
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        for k, r in enumerate(responses):
            r = r + group if r else 0
            tokens.append(prompt + torch.randint(3, vocab, (r,), generator=g).tolist())
            prompt_lengths.append(p)
            response_lengths.append(r)
            ids.append((group, k))
    n = len(tokens)
    return TrainBatch(tokens=tokens, prompt_lengths=prompt_lengths, response_lengths=response_lengths,
                      group_size=len(responses), rewards=torch.rand(n, generator=g).tolist(),
                      rollout_logprobs=[(-torch.rand(r, generator=g)).tolist() for r in response_lengths],
                      temperature=0.8, sample_ids=ids)


def settings(n: int, **kw) -> StepSettings:
    return StepSettings(**{"micro_batch_size": 8, "global_batch_size": n, "pad_id": 0, "grad_clip": 0.0,
                           "policy_loss": "ppo_clip", "loss_params": LossParams(), "advantage_estimator": "grpo",
                           **kw})


def assert_same_logprobs(model, batch: TrainBatch, atol: float = 2e-6, **kw) -> None:
    everyone = [list(range(len(batch)))]
    want = response_logprobs(model, batch, everyone, settings(len(batch), device=kw.get("device", "cpu")))
    got = response_logprobs(model, batch, everyone, settings(len(batch), share_prompts=True, **kw))
    assert sorted(got) == sorted(want)
    for i in want:
        assert got[i].shape == want[i].shape == (batch.response_lengths[i],)
        assert torch.allclose(got[i], want[i], atol=atol), (i, float((got[i] - want[i]).abs().max()))


def step_delta(model, batch: TrainBatch, **kw) -> tuple[torch.Tensor, dict]:
    """The parameter change of one SGD step (lr 1: minus the gradient) and the step's metrics."""
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = train_on_batch(model, optimizer, scheduler, batch, settings(len(batch), **kw), 0, 1)
    delta = torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters() if n in before])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in before:
                p.copy_(before[n])
    return delta, metrics


def assert_same_step(model, batch: TrainBatch, **kw) -> None:
    want, want_m = step_delta(model, batch, **kw)  # kw: the step's settings, the same both ways
    got, got_m = step_delta(model, batch, share_prompts=True, **kw)
    assert want.abs().max() > 0
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-4), float((got - want).abs().max())
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/clipfrac"):
        if key in want_m:
            # float32 sums in another order: a few units in the last place of values near 6
            assert got_m[key] == pytest.approx(want_m[key], rel=1e-6, abs=1e-6), key


# ---- the layout -------------------------------------------------------------------------------------


def test_units_share_the_longest_common_prefix_within_the_shortest_prompt():
    batch = TrainBatch(tokens=[[1, 2, 3, 4, 9], [1, 2, 3, 5, 9, 9], [1, 2, 3, 4, 8], [7, 7, 7]],
                       prompt_lengths=[4, 4, 3, 2], response_lengths=[1, 2, 2, 1],
                       sample_ids=[(0, 0), (0, 1), (0, 2), (1, 0)])
    assert common_prefix(batch, [0, 2]) == 3  # identical for 4 tokens, but sample 2's prompt has 3
    assert common_prefix(batch, [0, 1]) == 3  # prompts that differ at the 4th token share 3
    assert plan_units(batch, [0, 1, 2, 3]) == [Unit((0, 1, 2), 3), Unit((3,), 0)]
    assert plan_units(batch, [0, 1, 2, 3], max_members=2) == [Unit((0, 1), 3), Unit((2,), 0), Unit((3,), 0)]
    # a row of at most 8 tokens: 3 shared + 2 + 3 = 8 fits, adding sample 2's 2 does not
    assert plan_units(batch, [0, 1, 2], max_tokens=8) == [Unit((0, 1), 3), Unit((2,), 0)]
    # every rank gets work: units are halved, largest first
    assert split_to([Unit((0, 1, 2), 3)], batch, 2) == [Unit((0,), 0), Unit((1, 2), 3)]
    assert split_to([Unit((3,), 0)], batch, 2) == [Unit((3,), 0)]  # nothing left to split


def test_each_sample_sees_its_own_positions_and_its_first_token_comes_from_the_prompt():
    batch = TrainBatch(tokens=[[10, 11, 12, 20, 21], [10, 11, 12, 30], [10, 11, 12, 40, 41, 42]],
                       prompt_lengths=[3, 3, 3], response_lengths=[2, 1, 3], sample_ids=[(0, k) for k in range(3)])
    mb = collate_shared(batch, plan_units(batch, [0, 1, 2]), 0)
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 40, 41, 42]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5]]
    unit, segment = mb.attention_layout
    assert segment.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3, 3]]
    # one flat row of predictions: every first token from the prompt's last position (column 2)
    rows, cols = mb.hidden_index
    assert cols.tolist() == [2, 3, 2, 2, 6, 7]
    assert mb.targets.tolist() == [[20, 21, 30, 40, 41, 42]]
    assert mb.spans == [(0, 0), (0, 2), (0, 3)] and mb.seq_index.tolist() == [[0, 0, 1, 2, 2, 2]]


def test_the_mask_lets_a_token_see_the_prompt_and_its_own_segment_only():
    batch = TrainBatch(tokens=[[10, 11, 20, 21], [10, 11, 30, 31], [50, 51, 52]], prompt_lengths=[2, 2, 2],
                       response_lengths=[2, 2, 1], sample_ids=[(0, 0), (0, 1), (1, 0)])
    mb = collate_shared(batch, plan_units(batch, [0, 1, 2]), 0)
    # rows as wide as the longest unit: [10 11 | 20 21 | 30 31] and [50 51 52 pad pad pad]
    mask = shared_prefix.attention_mask(tiny("qwen2"), mb)[:, 0]
    assert mask.shape == (2, 6, 6)
    see = {(row, q): [k for k in range(6) if mask[row, q, k]] for row in range(2) for q in range(6)}
    assert see[0, 3] == [0, 1, 2, 3]  # 21: the prompt and 20
    assert see[0, 5] == [0, 1, 4, 5]  # 31: the prompt and 30, not 20 21
    assert see[1, 2] == [0, 1, 2] and see[1, 4] == [3, 4]  # padding: a unit of its own
    eager = shared_prefix.attention_mask(tiny("qwen2", "eager"), mb)[:, 0]
    assert bool(((eager == 0) == mask).all())  # the additive form: 0 where allowed, a large negative elsewhere


def test_flash_attention_cannot_take_the_layout():
    model = tiny("qwen2")
    model.config._attn_implementation = "flash_attention_2"
    batch = grouped_batch()
    with pytest.raises(ValueError, match="train.share_prompts=false"):
        shared_prefix.attention_mask(model, collate_shared(batch, plan_units(batch, [0, 1]), 0))


def test_a_group_stays_on_one_rank_and_every_rank_runs_as_many_micro_batches():
    batch = grouped_batch(prompts=(7, 4, 11, 5))  # 4 groups of 4
    s = settings(16, share_prompts=True, micro_batch_size=4)
    ranks = [assign_ranks(batch, list(range(16)), s, rank, 2) for rank in range(2)]
    assert sorted(ranks[0] + ranks[1]) == list(range(16))
    for mine in ranks:
        assert {batch.sample_ids[i][0] for i in mine} in ({0, 3}, {1, 2}, {0, 1}, {2, 3}, {0, 2}, {1, 3})
        assert len(micro_batches(batch, mine, s)) == 2  # a group of 4 per micro-batch
    # one group on two ranks: split in halves, each half sharing its prompt
    one = grouped_batch(prompts=(9,))
    halves = [assign_ranks(one, [0, 1, 2, 3], settings(4, share_prompts=True), rank, 2) for rank in range(2)]
    assert sorted(halves[0] + halves[1]) == [0, 1, 2, 3] and all(len(h) == 2 for h in halves)


def test_a_micro_batch_with_nothing_shared_takes_the_plain_layout():
    batch = grouped_batch(responses=(3,))  # one sample per prompt
    mbs = micro_batches(batch, [0, 1, 2], settings(3, share_prompts=True))
    assert [mb.hidden_index for mb in mbs] == [None] and mbs[0].attention_mask is not None


# ---- equal to the unshared computation ---------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logprobs_and_the_step_equal_the_unshared_ones_on_each_family(family):
    model = tiny(family)
    batch = grouped_batch()
    assert_same_logprobs(model, batch)
    assert_same_step(model, batch)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("chunk_mb", [0.0, 0.01])
@pytest.mark.parametrize("budget", [None, 40])
def test_either_attention_either_head_padded_or_packed(attention, chunk_mb, budget):
    model = tiny("llama", attention)
    assert_same_logprobs(model, grouped_batch(), logits_chunk_mb=chunk_mb, max_tokens_per_micro_batch=budget)
    # against the packed layout too, in the same budget
    batch = grouped_batch()
    packed = response_logprobs(model, batch, [list(range(12))], settings(12, max_tokens_per_micro_batch=40))
    shared = response_logprobs(model, batch, [list(range(12))], settings(12, share_prompts=True,
                                                                          max_tokens_per_micro_batch=budget))
    assert all(torch.allclose(packed[i], shared[i], atol=2e-6) for i in packed)


@pytest.mark.parametrize("agg, loss", [("token_mean", "ppo_clip"), ("seq_mean_token_mean", "ppo_clip"),
                                       ("seq_mean_token_sum_norm", "gspo")])
def test_every_aggregation_and_a_sequence_level_loss(agg, loss):
    assert_same_step(tiny("qwen2"), grouped_batch(seed=1), loss_agg_mode=agg, policy_loss=loss,
                     loss_params=LossParams(entropy_coef=0.01, kl_loss_coef=0.0), max_response_len=12)


def test_lora_adapters_get_the_same_gradients(tmp_path):
    model = tiny("qwen2")
    apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules="all-linear"), str(tmp_path))
    with torch.no_grad():  # adapters that do something (B starts at 0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = grouped_batch(seed=2)
    assert_same_logprobs(model, batch)
    assert_same_step(model, batch)


def test_multi_turn_samples_share_only_what_is_identical():
    """Samples of one group whose prompts hold earlier turns that differ (segments of trajectories), and
    responses with inserted tool output (loss-masked): shared is the first turn, not one token more."""
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, 300, (6,), generator=g).tolist()
    tokens, prompt_lengths, response_lengths, masks = [], [], [], []
    for k in range(4):
        turn = torch.randint(3, 300, (k + 2,), generator=g).tolist()  # a different earlier turn each
        response = torch.randint(3, 300, (5,), generator=g).tolist()
        tokens.append(first + turn + response)
        prompt_lengths.append(len(first) + len(turn))
        response_lengths.append(5)
        masks.append([1, 1, 0, 0, 1])  # tool output in the middle
    batch = TrainBatch(tokens=tokens, prompt_lengths=prompt_lengths, response_lengths=response_lengths, group_size=4,
                       rewards=[1.0, 0.0, 0.5, 0.0], rollout_logprobs=[[-0.5] * 5] * 4, temperature=1.0,
                       sample_ids=[(0, k) for k in range(4)], loss_masks=masks)
    assert plan_units(batch, [0, 1, 2, 3]) == [Unit((0, 1, 2, 3), 6)]
    model = tiny("qwen3")
    assert_same_logprobs(model, batch)
    assert_same_step(model, batch)


def test_a_value_model_reads_the_same_values():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**SMALL, num_labels=1)
    critic = transformers.Qwen2ForTokenClassification(config).float().eval()  # no dropout
    batch = grouped_batch()
    from tether.trainer.head import model_inputs

    def values(mb):
        return mb.at_predictions(critic(**model_inputs(critic, mb)).logits[..., 0])

    plain = collate(batch, list(range(12)), 0)
    shared = collate_shared(batch, plan_units(batch, list(range(12))), 0)
    with torch.no_grad():
        want, got = values(plain), values(shared)
    for (row, start), (_, flat), i in zip(plain.spans, shared.spans, range(12)):
        r = batch.response_lengths[i]
        assert torch.allclose(got[0, flat : flat + r], want[row, start : start + r], atol=1e-5)


def test_smollm2_real_prompts(smollm2_dir):
    """The pretrained model (Llama, 49,152 tokens) on chat-formatted prompts and sampled-length answers."""
    from tether.models.hf import load_model, load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_dir))
    model = load_model(str(smollm2_dir), "float32")
    g = torch.Generator().manual_seed(0)
    tokens, prompt_lengths, response_lengths, ids = [], [], [], []
    for group, question in enumerate(["What is 17 + 25?", "Name a prime number larger than 10."]):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        for k in range(3):
            r = 4 + 3 * k
            tokens.append(list(prompt) + torch.randint(100, 49000, (r,), generator=g).tolist())
            prompt_lengths.append(len(prompt))
            response_lengths.append(r)
            ids.append((group, k))
    batch = TrainBatch(tokens=tokens, prompt_lengths=prompt_lengths, response_lengths=response_lengths, group_size=3,
                       rewards=[1.0, 0.0, 0.0, 0.0, 1.0, 1.0], rollout_logprobs=[[-2.0] * r for r in response_lengths],
                       temperature=0.8, sample_ids=ids)
    assert_same_logprobs(model, batch, atol=5e-5)
    # The first layer's weights train: their gradients come back through every layer's attention.
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("model.layers.0."))
    want, _ = step_delta(model, batch)
    got, _ = step_delta(model, batch, share_prompts=True)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-3), float((got - want).abs().max())
