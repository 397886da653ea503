"""Continuous batching: joining, leaving, prefix sharing, and log-probs equal to the trainer's."""

from __future__ import annotations

import copy

import pytest
import torch

from tether.trainer.batch import TrainBatch
from tether.engine.batcher import ContinuousBatcher
from tests.reference_generate import generate_batch
from tether.engine.kernels import pack_linears
from tether.engine.sampling import SamplingParams
from tether.models.tiny import build_char_tokenizer, build_tiny_model
from tether.models.hf import load_model
from tether.trainer.step import StepSettings, response_logprobs


@pytest.fixture(scope="module")
def model(small_model):
    return small_model


def run_until_done(batcher: ContinuousBatcher, arrivals: dict[int, list]) -> dict:
    """arrivals: step -> [(key, prompt, params, seed)]; returns key -> Sequence."""
    done, step = {}, 0
    while arrivals or len(batcher.batch):
        new = arrivals.pop(step, [])
        seqs = [batcher.new_sequence(k, p, sp, seed) for k, p, sp, seed in new]
        finished = batcher.prefill(seqs)
        if len(batcher.batch):
            finished += batcher.decode_step()
        done.update({s.key: s for s in finished})
        step += 1
    return done


def alone(model, prompt, params, seed):
    """The same request served by itself."""
    return run_until_done(ContinuousBatcher(model, {1}, 0), {0: [("only", prompt, params, seed)]})["only"]


@pytest.fixture(params=["torch", "onednn"])
def engine_model(request, model):
    """The model as the engine runs it: torch's linears, or oneDNN's packed ones (kernels.py)."""
    if request.param == "torch":
        return model
    packed = copy.deepcopy(model)
    assert pack_linears(packed) > 0
    return packed


def test_late_joiners_match_running_alone(engine_model):
    model = engine_model
    greedy = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=7, ignore_eos=True)
    short = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)
    arrivals = {0: [("a", [5, 6, 7, 8], greedy, 1), ("b", [9], sampled, 2)],
                2: [("c", [10, 11, 12, 13, 14, 15], sampled, 3), ("d", [7, 7], short, 4)],
                5: [("e", [20, 21], greedy, 5)]}
    expected = {k: alone(model, p, sp, seed) for items in arrivals.values() for k, p, sp, seed in items}
    got = run_until_done(ContinuousBatcher(model, {1}, 0), dict(arrivals))
    # greedy rows also match the static-batch generator
    assert got["a"].output_ids == generate_batch(model, [[5, 6, 7, 8]], greedy, {1}, 0)[0].output_ids
    for key, ref in expected.items():
        assert got[key].output_ids == ref.output_ids, key
        assert max(abs(a - b) for a, b in zip(got[key].output_logprobs, ref.output_logprobs)) < 1e-5, key
        assert got[key].finish_reason == "length"


def test_finished_rows_leave_and_columns_are_trimmed(model):
    batcher = ContinuousBatcher(model, {1}, 0)
    long = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    batcher.prefill([batcher.new_sequence("long-prompt", list(range(5, 25)), short, 0),
                     batcher.new_sequence("short-prompt", [5, 6], long, 0)])
    assert len(batcher.batch) == 2 and batcher.batch.mask.shape[1] == 20
    finished = batcher.decode_step()
    assert [s.key for s in finished] == ["long-prompt"] and len(batcher.batch) == 1
    # only the short row is left: the 18 columns of padding in front of it are gone
    assert batcher.batch.mask.shape[1] == 3 and bool(batcher.batch.mask.all())
    assert batcher.batch.cache.layers[0].keys.shape[2] == 3


def test_group_prompts_are_prefilled_once(model):
    batcher = ContinuousBatcher(model, {1}, 0)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10]
    seqs = [batcher.new_sequence(i, prompt, params, i) for i in range(8)]
    batcher.prefill(seqs)
    assert batcher.stats["prefill_tokens"] == 6 and batcher.stats["prefill_tokens_shared"] == 42
    done = {}
    while len(batcher.batch):
        done.update({s.key: s for s in batcher.decode_step()})
    for i in range(8):  # sharing the prompt's cache changes nothing about each sample
        assert done[i].output_ids == alone(model, prompt, params, i).output_ids


def test_abort_finishes_a_row_with_what_it_has(model):
    batcher = ContinuousBatcher(model, {1}, 0)
    params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    batcher.prefill([batcher.new_sequence(k, [5, 6], params, 0) for k in ("x", "y")])
    batcher.decode_step()
    finished = batcher.decode_step(abort={0})
    assert [s.key for s in finished] == ["x"] and finished[0].finish_reason == "abort"
    assert len(finished[0].output_ids) == 2 and len(batcher.batch) == 1
    assert [s.finish_reason for s in batcher.abort_all()] == ["abort"] and len(batcher.batch) == 0


def test_engine_logprobs_equal_trainer_recomputation(model, engine_model):
    """On-policy exactness in float32: mean |engine - trainer| under 1e-6 for sampled responses.

    With oneDNN linears in the engine too, while the trainer keeps torch's matmul.
    """
    params = SamplingParams(temperature=0.7, max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [5, 6, 7]]
    arrivals = {0: [(i, p, params, i) for i, p in enumerate(prompts[:2])],
                3: [(i + 2, p, params, i + 2) for i, p in enumerate(prompts[2:])]}
    got = run_until_done(ContinuousBatcher(engine_model, {1}, 0), arrivals)
    seqs = [got[i] for i in range(4)]
    batch = TrainBatch(tokens=[s.prompt + s.output_ids for s in seqs], prompt_lengths=[len(s.prompt) for s in seqs],
                       response_lengths=[len(s.output_ids) for s in seqs], temperature=0.7)
    settings = StepSettings(micro_batch_size=4, global_batch_size=4, pad_id=0, grad_clip=0.0, policy_loss="ppo_clip",
                            loss_params=None, advantage_estimator="grpo")
    trainer = response_logprobs(model, batch, [list(range(4))], settings)
    diffs = torch.cat([(trainer[i] - torch.tensor(seqs[i].output_logprobs)).abs() for i in range(4)])
    assert float(diffs.mean()) < 1e-6 and float(diffs.max()) < 1e-5


def test_bfloat16_model_generates(tmp_path):
    path = build_tiny_model(tmp_path, build_char_tokenizer(), hidden_size=32, num_layers=1, num_heads=4,
                            num_kv_heads=2, intermediate_size=64, max_positions=64)
    bf16 = load_model(str(path), "bfloat16").eval()
    batcher = ContinuousBatcher(bf16, {1}, 0)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    batcher.prefill([batcher.new_sequence(0, [5, 6], params, 0)])
    done = []
    while len(batcher.batch):
        done += batcher.decode_step()
    (seq,) = done
    assert len(seq.output_ids) == 4 and all(lp <= 0 for lp in seq.output_logprobs)


def test_counter_based_sampling_matches_the_distribution():
    """The inverse CDF at a hashed uniform draws from softmax(logits / T): check frequencies over many seeds."""
    from tether.engine.row_sampling import sample_rows

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    params = [SamplingParams(temperature=0.8)] * 20000
    tokens, logprobs = sample_rows(logits, params, torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    freq = torch.bincount(tokens, minlength=4).double() / 20000
    expected = torch.softmax(logits[0].double() / 0.8, -1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)
    assert torch.allclose(logprobs, torch.log(expected).float()[tokens], atol=1e-6)
    again, _ = sample_rows(logits[:3], params[:3], torch.arange(3), torch.zeros(3, dtype=torch.long))
    assert torch.equal(again, tokens[:3])  # a row's draw does not depend on its batch-mates
