"""Unit tests for the embedded inference engine, in-process (no Ray): sampling, batched generation,
agreement with the trainer's log-prob recomputation, and weight / memory management."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tether.algorithms.losses import LossParams
from tether.trainer.batch import TrainBatch
from tether.engine.base import MEMORY_TAGS
from tether.engine.core import EngineCore
from tether.engine.embedded import EmbeddedEngine, EngineError
from tests.reference_generate import filter_logits, generate_batch, sample_next
from tether.engine.generate import left_pad
from tether.engine.sampling import SamplingParams
from tether.models.tiny import build_tiny_model
from tether.models.hf import load_model
from tether.trainer.step import StepSettings, forward_logprobs, response_logprobs

PROMPTS = ["1+2=", "hello world", "a", "12*34=?", "x", "The sum of 3 and 4 is"]


# --------------------------------------------------------------------------- #
# fixtures
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("engine_tiny_model")
    return build_tiny_model(out, tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_positions=64)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(str(model_dir), "float32").eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(text) for text in PROMPTS]
    assert len({len(p) for p in ids}) > 2  # lengths differ: left padding is exercised
    return ids


@pytest.fixture
def engine(model_dir) -> EmbeddedEngine:
    """A fresh engine per test: the memory tests change its state."""
    return EmbeddedEngine(str(model_dir), dtype="float32", max_batch=4)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _step_settings(pad_id: int, micro_batch_size: int = 3) -> StepSettings:
    return StepSettings(micro_batch_size=micro_batch_size, global_batch_size=micro_batch_size, pad_id=pad_id,
                        grad_clip=1.0, policy_loss="ppo_clip", loss_params=LossParams(), advantage_estimator="grpo")


def _requests(prompts, params) -> list[tuple[list[int], SamplingParams]]:
    return [(list(p), params) for p in prompts]


def _generate(engine: EmbeddedEngine, requests, seed: int):
    """Through a serving core, the path every request takes (request i samples with seed + i); the
    core admits at most engine.max_batch rows at once, so larger request lists run in waves."""
    core = EngineCore(engine, engine.tokenizer, max_batch=engine.max_batch)
    try:
        reqs = core.submit_many([(p, replace(params, seed=seed + i), None) for i, (p, params) in enumerate(requests)])
        return [r.future.result(timeout=60) for r in reqs]
    finally:
        core.shutdown()


# --------------------------------------------------------------------------- #
# sampling
# --------------------------------------------------------------------------- #


def _kept(filtered: torch.Tensor) -> set[int]:
    return set(torch.isfinite(filtered).nonzero().flatten().tolist())


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_k(k):
    logits = torch.randn(4, 20, generator=_gen(1))
    filtered = filter_logits(logits, top_k=k, top_p=1.0)
    for row in range(4):
        assert _kept(filtered[row]) == set(torch.topk(logits[row], k).indices.tolist())
        # Kept logits are unchanged.
        kept = torch.isfinite(filtered[row])
        assert torch.equal(filtered[row][kept], logits[row][kept])


def test_top_k_off_or_larger_than_vocab_keeps_all():
    logits = torch.randn(2, 5, generator=_gen(2))
    assert torch.equal(filter_logits(logits, top_k=-1, top_p=1.0), logits)
    assert torch.equal(filter_logits(logits, top_k=5, top_p=1.0), logits)
    assert torch.equal(filter_logits(logits, top_k=50, top_p=1.0), logits)


def test_top_p_keeps_the_smallest_nucleus_on_known_probs():
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()[None]
    assert _kept(filter_logits(logits, -1, 0.75)[0]) == {1, 3}
    assert _kept(filter_logits(logits, -1, 0.45)[0]) == {1}
    assert _kept(filter_logits(logits, -1, 0.9)[0]) == {1, 3, 0}
    assert _kept(filter_logits(logits, -1, 0.99)[0]) == {0, 1, 2, 3}


def _nucleus_reference(logits: torch.Tensor, top_p: float) -> set[int]:
    probs = torch.softmax(logits.double(), -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("seed", range(5))
def test_top_p_matches_a_loop_reference(seed):
    g = _gen(seed)
    logits = torch.randn(6, 12, generator=g) * 2
    for row in range(6):
        top_p = float(torch.rand((), generator=g)) * 0.9 + 0.05
        assert _kept(filter_logits(logits[row : row + 1], -1, top_p)[0]) == _nucleus_reference(logits[row], top_p)


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 3.5, -2.0]])
    filtered = filter_logits(logits, -1, 1e-6)
    assert _kept(filtered[0]) == {1}
    assert _kept(filtered[1]) == {1}


def test_top_k_then_top_p_renormalises_over_the_top_k():
    # top-2 leaves 0.35 and 0.3, renormalised to 0.54 / 0.46: top_p=0.5 keeps only the first,
    # although 0.35 alone is below 0.5 of the unfiltered mass.
    logits = torch.tensor([0.3, 0.2, 0.15, 0.35]).log()[None]
    assert _kept(filter_logits(logits, 2, 1.0)[0]) == {0, 3}
    assert _kept(filter_logits(logits, 2, 0.5)[0]) == {3}
    assert _kept(filter_logits(logits, 2, 0.7)[0]) == {0, 3}


def test_greedy_sampling_is_argmax_with_temperature_one_logprobs():
    logits = torch.randn(5, 30, generator=_gen(3)) * 3
    tokens, logprobs = sample_next(logits, SamplingParams(temperature=0), None)
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected)


def test_top_k_one_is_greedy():
    logits = torch.randn(5, 30, generator=_gen(4))
    tokens, _ = sample_next(logits, SamplingParams(temperature=1.3, top_k=1), _gen(0))
    assert torch.equal(tokens, logits.argmax(-1))


def test_sampled_logprob_is_unfiltered_at_temperature():
    logits = torch.randn(64, 10, generator=_gen(5))
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    tokens, logprobs = sample_next(logits, params, _gen(1))
    top3 = torch.topk(logits, 3).indices
    assert bool((tokens[:, None] == top3).any(-1).all())  # only filtered-in tokens are drawn
    # The reported log-prob is under softmax(logits / T) without the filter (what the trainer recomputes).
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected)


def test_sampling_with_a_seeded_generator_is_reproducible():
    logits = torch.randn(8, 40, generator=_gen(6))
    params = SamplingParams(temperature=1.0)
    a, _ = sample_next(logits, params, _gen(9))
    b, _ = sample_next(logits, params, _gen(9))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_sampling_params_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_sampling_params_valid_and_hashable():
    params = SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_new_tokens=1, stop_token_ids=(3,))
    assert {params: 1}[SamplingParams(temperature=0, max_new_tokens=1, stop_token_ids=(3,))] == 1


# --------------------------------------------------------------------------- #
# batched generation
# --------------------------------------------------------------------------- #


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        left_pad([[1], []], pad_id=0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=10),
                                    SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(71, 16))],
                         ids=["no-stop", "rows-stop-early"])
def test_batched_greedy_equals_one_prompt_at_a_time(model, tokenizer, prompts, params):
    eos = {tokenizer.eos_token_id}
    batched = generate_batch(model, prompts, params, eos, tokenizer.pad_token_id)
    assert len(batched) == len(prompts)
    for prompt, out in zip(prompts, batched):
        alone = generate_batch(model, [prompt], params, eos, tokenizer.pad_token_id)[0]
        assert out.output_ids == alone.output_ids
        assert out.finish_reason == alone.finish_reason
        assert len(out.output_logprobs) == len(out.output_ids)
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, alone.output_logprobs)) < 1e-5


def test_stop_at_eos_and_length(model, tokenizer, prompts):
    pad = tokenizer.pad_token_id
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    free = generate_batch(model, prompts, greedy, {tokenizer.eos_token_id}, pad)
    # Without an eos in the output every row runs to the limit.
    for out in free:
        assert tokenizer.eos_token_id not in out.output_ids
        assert out.finish_reason == "length" and len(out.output_ids) == 6
    # Declare the third greedy token of row 0 to be the eos: row 0 stops right there, keeping it.
    eos = free[0].output_ids[2]
    stopped = generate_batch(model, prompts, greedy, {eos}, pad)
    for before, after in zip(free, stopped):
        if eos in before.output_ids:
            cut = before.output_ids.index(eos) + 1
            assert after.finish_reason == "stop"
            assert after.output_ids == before.output_ids[:cut] and after.output_ids[-1] == eos
            assert after.output_logprobs == pytest.approx(before.output_logprobs[:cut], abs=1e-5)
        else:
            assert after.finish_reason == "length" and after.output_ids == before.output_ids
    assert stopped[0].finish_reason == "stop" and len(stopped[0].output_ids) <= 3


def test_sampled_outputs_end_at_stop_tokens(model, tokenizer, prompts):
    stop = tuple(range(4, 40))  # about half the vocabulary: most rows stop early
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=stop)
    outs = generate_batch(model, prompts * 3, params, {tokenizer.eos_token_id}, tokenizer.pad_token_id, _gen(0))
    stops = set(stop) | {tokenizer.eos_token_id}
    reasons = set()
    for out in outs:
        reasons.add(out.finish_reason)
        assert all(t not in stops for t in out.output_ids[:-1])  # nothing after a stop token
        if out.finish_reason == "stop":
            assert out.output_ids[-1] in stops
        else:
            assert len(out.output_ids) == 8 and out.output_ids[-1] not in stops
    assert "stop" in reasons


def test_seed_reproduces_and_different_seed_differs(engine, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    requests = _requests(prompts, params)
    first = _generate(engine, requests, seed=123)
    again = _generate(engine, requests, seed=123)
    other = _generate(engine, requests, seed=124)
    assert [o.output_ids for o in first] == [o.output_ids for o in again]
    assert [o.output_logprobs for o in first] == [o.output_logprobs for o in again]
    assert [o.output_ids for o in first] != [o.output_ids for o in other]


@pytest.mark.parametrize("top_p, top_k", [(1.0, -1), (0.9, 10)])
def test_engine_logprobs_equal_trainer_recomputation(engine, tokenizer, prompts, top_p, top_k):
    temperature = 0.7
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=10)
    group = 2
    requests = _requests([p for p in prompts for _ in range(group)], params)  # 12 > max_batch=4: three chunks
    outputs = _generate(engine, requests, seed=7)
    batch = TrainBatch(
        tokens=[p + o.output_ids for (p, _), o in zip(requests, outputs)],
        prompt_lengths=[len(p) for p, _ in requests],
        response_lengths=[len(o.output_ids) for o in outputs],
        group_size=group,
        rewards=[0.0] * len(requests),
        rollout_logprobs=[o.output_logprobs for o in outputs],
        temperature=temperature,
    )
    batch.validate()
    recomputed = response_logprobs(engine.model, batch, [list(range(len(batch)))], _step_settings(tokenizer.pad_token_id))
    assert sorted(recomputed) == list(range(len(batch)))
    worst = 0.0
    for i in range(len(batch)):
        assert recomputed[i].shape == (batch.response_lengths[i],)
        diff = (recomputed[i] - torch.tensor(batch.rollout_logprobs[i])).abs()
        worst = max(worst, float(diff.max()))
    assert worst < 1e-5


def test_forward_logprobs_shapes_and_entropy_modes(model, tokenizer, prompts):
    batch = TrainBatch(tokens=prompts[:3], prompt_lengths=[1, 1, 1], response_lengths=[len(p) - 1 for p in prompts[:3]])
    from tether.trainer.batch import collate

    mb = collate(batch, [0, 1, 2], tokenizer.pad_token_id)
    logprobs, entropy = forward_logprobs(model, mb, 1.0, "none")
    assert logprobs.shape == mb.targets.shape and entropy is None
    assert bool((logprobs <= 0).all())
    _, ent_metric = forward_logprobs(model, mb, 1.0, "metric")
    assert ent_metric.shape == mb.targets.shape and not ent_metric.requires_grad
    _, ent_grad = forward_logprobs(model, mb, 1.0, "grad")
    assert ent_grad.requires_grad
    torch.testing.assert_close(ent_grad.detach(), ent_metric)
    # Entropy is at most log(V).
    assert float(ent_metric.max()) <= math.log(len(tokenizer)) + 1e-4


# --------------------------------------------------------------------------- #
# EmbeddedEngine: weights and memory
# --------------------------------------------------------------------------- #


def _state(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.model.state_dict().items()}


def test_engine_basics(engine, tokenizer):
    assert engine.eos_ids == {tokenizer.eos_token_id}
    assert engine.pad_id == tokenizer.pad_token_id
    health = engine.health()
    assert health["ok"] is True and health["weight_version"] == 0 and health["released"] == []
    assert health["kv_cache"] is True


def test_engine_generate_preserves_request_order_across_sampling_groups(engine, prompts):
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    shorter = SamplingParams(temperature=0, max_new_tokens=3)
    mixed = [(list(p), greedy if i % 2 else shorter) for i, p in enumerate(prompts)]
    outs = _generate(engine, mixed, seed=0)
    assert [len(o.output_ids) for o in outs] == [3 if i % 2 == 0 else 5 for i in range(len(prompts))]
    alone = [_generate(engine, [r], seed=0)[0] for r in mixed]
    assert [o.output_ids for o in outs] == [o.output_ids for o in alone]


def test_release_weights_frees_storage_and_blocks_generate(engine, prompts):
    engine.release_memory(["weights"])
    assert all(p.numel() == 0 for p in engine.model.parameters())
    assert engine.health()["released"] == ["weights"]
    with pytest.raises(EngineError, match="resume"):
        _generate(engine, _requests(prompts[:1], SamplingParams(temperature=0, max_new_tokens=2)), seed=0)
    # Releasing twice is harmless.
    engine.release_memory(["weights"])
    assert engine.health()["released"] == ["weights"]


def test_release_kv_cache_blocks_generate_until_resumed(engine, prompts):
    requests = _requests(prompts[:2], SamplingParams(temperature=0, max_new_tokens=2))
    engine.release_memory(["kv_cache"])
    assert engine.health()["kv_cache"] is False
    with pytest.raises(EngineError, match="resume"):
        _generate(engine, requests, seed=0)
    engine.resume_memory(["kv_cache"])
    assert len(_generate(engine, requests, seed=0)) == 2


def test_resume_and_reload_restores_identical_outputs(engine, prompts):
    requests = _requests(prompts[:4], SamplingParams(temperature=0.8, max_new_tokens=6))
    before = _generate(engine, requests, seed=5)
    state = _state(engine)
    engine.release_memory(["weights", "kv_cache"])
    engine.resume_memory(["weights", "kv_cache"])
    assert all(p.numel() > 0 for p in engine.model.parameters())
    names = sorted(state)
    half = len(names) // 2
    assert engine.load_weight_bucket({n: state[n] for n in names[:half]}, version=1) == half
    assert engine.load_weight_bucket({n: state[n] for n in names[half:]}, version=1) == len(names) - half
    assert engine.commit_weights(1) == 1
    assert engine.health()["weight_version"] == 1
    after = _generate(engine, requests, seed=5)
    assert [o.output_ids for o in after] == [o.output_ids for o in before]
    assert [o.output_logprobs for o in after] == [o.output_logprobs for o in before]


def test_commit_after_resume_without_all_tensors_raises(engine):
    state = _state(engine)
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])
    some = dict(list(state.items())[:3])
    engine.load_weight_bucket(some, version=2)
    with pytest.raises(EngineError, match="never loaded"):
        engine.commit_weights(2)
    assert engine.health()["weight_version"] == 0
    engine.load_weight_bucket(state, version=2)
    assert engine.commit_weights(2) == 2


def test_weight_update_without_release_commits(engine, prompts):
    # A plain update (no offload): new values are served after commit.
    requests = _requests(prompts[:3], SamplingParams(temperature=0, max_new_tokens=6))
    before = _generate(engine, requests, seed=0)
    state = _state(engine)
    changed = {name: t * 1.5 if t.dim() == 2 else t for name, t in state.items()}
    engine.load_weight_bucket(changed, version=1)
    engine.commit_weights(1)
    after = _generate(engine, requests, seed=0)
    assert [o.output_logprobs for o in after] != [o.output_logprobs for o in before]


def test_load_weight_bucket_unknown_name(engine):
    with pytest.raises(EngineError, match="'model.not_a_tensor'"):
        engine.load_weight_bucket({"model.not_a_tensor": torch.zeros(2)}, version=1)


def test_load_weight_bucket_wrong_shape(engine):
    name = "model.layers.0.mlp.up_proj.weight"
    shape = tuple(engine.model.get_parameter(name).shape)
    with pytest.raises(EngineError) as info:
        engine.load_weight_bucket({name: torch.zeros(shape[0] + 1, shape[1])}, version=1)
    assert name in str(info.value)
    assert str(shape) in str(info.value)


def test_unknown_memory_tag(engine):
    for method in (engine.release_memory, engine.resume_memory):
        with pytest.raises(ValueError) as info:
            method(["weights", "activations"])
        assert "activations" in str(info.value)
        for tag in MEMORY_TAGS:
            assert tag in str(info.value)
    # Nothing was released by the failed call.
    assert engine.health()["released"] == []


def test_generate_after_resume_without_reload_raises(engine, prompts):
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])
    with pytest.raises(EngineError):
        _generate(engine, _requests(prompts[:1], SamplingParams(temperature=0, max_new_tokens=2)), seed=0)


# --------------------------------------------------------------------------- #
# admission: a step's prefill is bounded, and health probes go first
# --------------------------------------------------------------------------- #


def test_a_step_prefills_what_its_budget_holds_and_a_groups_prompt_counts_once(engine):
    core = EngineCore(engine, engine.tokenizer, max_batch=64)
    core.pause()  # the worker holds while the queue fills
    try:
        prompts = [[5 + i] * 6 for i in range(6)]
        core.prefill_budget = 2 * 6  # two distinct prompts of 6 tokens a step (too few tokens to re-measure)
        params = SamplingParams(temperature=0.0, max_new_tokens=2)
        distinct = core.submit_many([(p, params, None) for p in prompts])
        group = core.submit_many([([3] * 6, params, None)] * 8)  # one prompt, eight samples: one row
        core.resume()
        assert all(len(r.future.result(timeout=60).output_ids) == 2 for r in distinct + group)
        # steps that admitted: 2 + 2 + 2 distinct prompts, then the group's eight together
        assert core.stats["prefills"] == 4, core.stats
        assert core.prefill_budget == 12
    finally:
        core.shutdown()


def test_a_health_probe_is_admitted_ahead_of_a_full_queue(engine, prompts):
    core = EngineCore(engine, engine.tokenizer, max_batch=2)
    core.pause()
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        queued = core.submit_many([(p, params, None) for p in prompts * 4])
        probe = core.submit_many([(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=1), None)],
                                 probe=True)[0]
        assert core._waiting[0] is probe  # ahead of the 24 waiting
        core.resume()
        probe.future.result(timeout=60)
        # answered after one step: the queue (two at a time, eight tokens each) is far from done
        assert sum(r.future.done() for r in queued) <= 2
        assert all(len(r.future.result(timeout=60).output_ids) == 8 for r in queued)
    finally:
        core.shutdown()


def test_the_prefill_budget_follows_the_measured_rate(engine):
    core = EngineCore(engine, engine.tokenizer)
    try:
        assert core.prefill_budget == 4096
        core._measure_prefill(4096, 10.0)  # 410 tokens/s: 3 s of it is 1228, halfway there
        assert core.prefill_budget == (4096 + 1228) // 2
        for _ in range(20):
            core._measure_prefill(100_000, 1.0)  # fast: capped by the KV budget
        assert core.prefill_budget == core.max_batch_tokens
        core._measure_prefill(100, 10.0)  # too small a prefill to measure
        assert core.prefill_budget == core.max_batch_tokens
    finally:
        core.shutdown()
