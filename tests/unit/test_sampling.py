"""Unit tests for per-row sampling and the per-request generation controls (in-process, no Ray):
mixed SamplingParams in one batch, per-request seeds, min_p, ignore_eos, stop strings, abort, per-row
max_new_tokens, and reproducibility of the historical single-params path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tether.algorithms.logprobs import token_logprobs
from tests.reference_generate import (filter_logits, filter_logits_rows, filter_min_p, generate_batch, make_generators,
                                      sample_next)
from tether.engine.generate import GenerateOutput
from tether.engine.sampling import SamplingParams
from tether.models.tiny import build_tiny_model
from tether.models.hf import load_model

PROMPTS = ["1+2=", "hello world", "a", "12*34=?", "x", "The sum of 3 and 4 is"]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("sampling_tiny_model")
    path = build_tiny_model(out, tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_positions=64)
    return load_model(str(path), "float32").eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in PROMPTS]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids)


class ScriptedModel(nn.Module):
    """A fake causal LM: at decode step s (the prefill is step 0) row r's logits strongly favour
    script[r][s] (token `fill` once the script runs out); records every input it is given."""

    def __init__(self, scripts: list[list[int]], vocab: int, fill: int = 5):
        super().__init__()
        self.scripts, self.vocab, self.fill = scripts, vocab, fill
        self.calls: list[torch.Tensor] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, past_key_values=None):
        step = len(self.calls)
        self.calls.append(input_ids.clone())
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], self.vocab)
        for row, script in enumerate(self.scripts):
            logits[row, -1, script[step] if step < len(script) else self.fill] = 12.0
        return SimpleNamespace(logits=logits)


# --------------------------------------------------------------------------- #
# the single-params path is unchanged
# --------------------------------------------------------------------------- #


def _legacy_sample_next(logits, params, generator):
    """The implementation before per-row params (kept here to check bit-identity)."""
    logits = logits.float()
    if params.temperature == 0:
        tokens, temperature = logits.argmax(-1), 1.0
    else:
        temperature = params.temperature
        probs = torch.softmax(filter_logits(logits / temperature, params.top_k, params.top_p), dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, token_logprobs(logits[:, None, :], tokens[:, None], temperature)[:, 0]


# Recorded with the implementation before per-row params, same seeds.
RECORDED_SAMPLE_NEXT = {
    0.8: ([10, 4, 29, 11, 31, 14], [-0.21846771240234375, -0.18309497833251953, -1.6327857971191406,
                                    -1.126659870147705, -0.8049397468566895, -0.48886632919311523]),
    1.0: ([10, 4, 29, 11, 31, 14], [-0.40629053115844727, -0.36664533615112305, -1.705359935760498,
                                    -1.432269811630249, -1.0879602432250977, -0.7884922027587891]),
}
RECORDED_GENERATE = [
    (SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=8),
     [[74, 33, 27, 24, 41, 35, 64, 66], [16, 35, 4, 36, 28, 5, 87, 76], [59, 76, 86, 84, 22, 37, 46, 76],
      [7, 16, 30, 45, 98, 11, 53, 71], [45, 4, 60, 60, 24, 88, 20, 59], [11, 66, 7, 89, 16, 48, 9, 6]],
     ["length"] * 6,
     [-4.484612, -4.449964, -4.458446, -4.432163, -4.505692, -4.47443, -4.507799, -4.455472]),
    (SamplingParams(temperature=0.7, max_new_tokens=8, stop_token_ids=tuple(range(4, 20))),
     [[58, 33, 80, 81, 71, 34, 25, 2], [69, 6], [59, 18], [79, 16], [40, 86, 17], [4]],
     ["length", "stop", "stop", "stop", "stop", "stop"],
     [-4.524922, -4.440053, -4.577662, -4.646958, -4.891953, -4.545974, -4.827847, -4.732145]),
]


def test_sample_next_reproduces_recorded_draws():
    logits = torch.randn(6, 40, generator=_gen(11)) * 2
    for params in (SamplingParams(temperature=0.8, top_k=10, top_p=0.9), SamplingParams(temperature=1.0)):
        tokens, logprobs = sample_next(logits, params, _gen(3))
        expected_tokens, expected_lp = RECORDED_SAMPLE_NEXT[params.temperature]
        assert tokens.tolist() == expected_tokens
        assert logprobs.tolist() == pytest.approx(expected_lp, abs=1e-6)


@pytest.mark.parametrize("params, ids, reasons, row0_lp", RECORDED_GENERATE, ids=["top-k-top-p", "stop-ids"])
def test_generate_batch_single_params_reproduces_recorded_tokens(model, tokenizer, prompts, params, ids, reasons,
                                                                 row0_lp):
    outs = generate_batch(model, prompts, params, {tokenizer.eos_token_id}, tokenizer.pad_token_id, _gen(0))
    assert [o.output_ids for o in outs] == ids
    assert [o.finish_reason for o in outs] == reasons
    assert outs[0].output_logprobs == pytest.approx(row0_lp, abs=1e-5)
    # The same call with the params spelled out per row draws the very same bits.
    listed = generate_batch(model, prompts, [params] * len(prompts), {tokenizer.eos_token_id},
                            tokenizer.pad_token_id, _gen(0))
    assert [(o.output_ids, o.output_logprobs) for o in listed] == [(o.output_ids, o.output_logprobs) for o in outs]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.6),
                                    SamplingParams(temperature=1.3, top_k=7), SamplingParams(top_p=0.8),
                                    SamplingParams(temperature=0.9, top_k=12, top_p=0.7)])
def test_uniform_path_is_bit_identical_to_the_legacy_implementation(params):
    logits = torch.randn(16, 64, generator=_gen(21)) * 3
    tokens, logprobs = sample_next(logits, params, _gen(5))
    legacy_tokens, legacy_lp = _legacy_sample_next(logits, params, _gen(5))
    assert torch.equal(tokens, legacy_tokens) and torch.equal(logprobs, legacy_lp)
    listed_tokens, listed_lp = sample_next(logits, [params] * 16, _gen(5))
    assert torch.equal(listed_tokens, legacy_tokens) and torch.equal(listed_lp, legacy_lp)


# --------------------------------------------------------------------------- #
# per-row filtering and sampling
# --------------------------------------------------------------------------- #


def _filter_one(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    out = filter_logits(row[None], top_k, top_p)
    return filter_min_p(out, torch.tensor([min_p]))[0]


@pytest.mark.parametrize("seed", range(4))
def test_filter_logits_rows_equals_filter_logits_on_each_row(seed):
    g = _gen(seed)
    n, vocab = 12, 50
    logits = torch.randn(n, vocab, generator=g) * 2
    choices_k = [-1, 1, 3, 10, 49, 50, 80]
    top_k = [choices_k[int(torch.randint(len(choices_k), (), generator=g))] for _ in range(n)]
    top_p = [1.0 if float(torch.rand((), generator=g)) < 0.4 else float(torch.rand((), generator=g)) * 0.95 + 0.05
             for _ in range(n)]
    min_p = [0.0 if float(torch.rand((), generator=g)) < 0.4 else float(torch.rand((), generator=g)) for _ in range(n)]
    filtered = filter_logits_rows(logits, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    for row in range(n):
        assert torch.equal(filtered[row], _filter_one(logits[row], top_k[row], top_p[row], min_p[row])), row


def test_filter_logits_rows_leaves_unfiltered_rows_alone():
    logits = torch.randn(3, 40, generator=_gen(8)) * 4
    filtered = filter_logits_rows(logits, torch.tensor([-1, 2, -1]), torch.tensor([1.0, 1.0, 0.5]),
                                  torch.tensor([0.0, 0.0, 0.0]))
    assert torch.equal(filtered[0], logits[0])
    assert int(torch.isfinite(filtered[1]).sum()) == 2


def test_min_p_keeps_tokens_relative_to_the_top_probability():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None]

    def kept(min_p: float) -> set[int]:
        out = filter_min_p(logits, torch.tensor([min_p]))[0]
        return set(torch.isfinite(out).nonzero().flatten().tolist())

    assert kept(0.0) == {0, 1, 2, 3}
    assert kept(0.25) == {0, 1, 2}  # threshold 0.125
    assert kept(0.5) == {0, 1}  # threshold 0.25
    assert kept(1.0) == {0}


def test_min_p_is_applied_after_temperature():
    # At T=2 the probabilities go as sqrt(p): ratios to the top are 1, .77, .55, .32, so min_p=0.5
    # keeps three tokens (at T=1 it would keep two). Draw many times to see exactly which.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None].repeat(3000, 1)
    hot, _ = sample_next(logits, SamplingParams(temperature=2.0, min_p=0.5), _gen(0))
    cold, _ = sample_next(logits, SamplingParams(temperature=1.0, min_p=0.5), _gen(0))
    assert set(hot.tolist()) == {0, 1, 2}
    assert set(cold.tolist()) == {0, 1}
    # Log-probs stay unfiltered: under softmax(logits / T) over the whole vocabulary.
    _, lp = sample_next(logits[:1], SamplingParams(temperature=2.0, min_p=0.5), _gen(1))
    assert float(lp[0]) <= 0 and float(lp[0]) > -2


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
]


def test_mixed_rows_equal_each_row_alone_with_its_own_generator():
    logits = torch.randn(len(MIXED), 30, generator=_gen(13)) * 2
    for trial in range(5):
        seeds = [100 * trial + row for row in range(len(MIXED))]
        tokens, logprobs = sample_next(logits, MIXED, [_gen(s) for s in seeds])
        for row, params in enumerate(MIXED):
            alone_tokens, alone_lp = sample_next(logits[row : row + 1], params, _gen(seeds[row]))
            assert int(tokens[row]) == int(alone_tokens[0])
            assert float(logprobs[row]) == float(alone_lp[0])
            temperature = params.temperature or 1.0
            expected = token_logprobs(logits[row][None, None], tokens[row][None, None], temperature)[0, 0]
            assert abs(float(logprobs[row]) - float(expected)) < 1e-6
        greedy = [row for row, p in enumerate(MIXED) if p.temperature == 0]
        assert tokens[greedy].tolist() == logits[greedy].argmax(-1).tolist()


def test_mixed_rows_with_one_generator_respect_each_rows_filter():
    base = torch.randn(1, 20, generator=_gen(17)) * 2
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.5, min_p=0.6), SamplingParams(temperature=1.0)] * 200
    tokens, logprobs = sample_next(base.repeat(len(params), 1), params, _gen(2))
    order = base[0].argsort(descending=True).tolist()
    probs = torch.softmax(base[0] / 0.5, -1)
    min_p_kept = set((probs >= 0.6 * probs.max()).nonzero().flatten().tolist())
    assert set(tokens[0::4].tolist()) == {order[0]}
    assert set(tokens[1::4].tolist()) <= set(order[:3]) and len(set(tokens[1::4].tolist())) > 1
    assert set(tokens[2::4].tolist()) <= min_p_kept
    assert len(set(tokens[3::4].tolist())) > 3
    for row in (0, 1, 2, 3):
        temperature = params[row].temperature
        expected = token_logprobs(base[None], tokens[row][None, None], temperature)[0, 0]
        assert abs(float(logprobs[row]) - float(expected)) < 1e-6


def test_sample_next_rejects_wrong_lengths():
    logits = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="params"):
        sample_next(logits, [SamplingParams()] * 2, None)
    with pytest.raises(ValueError, match="generators"):
        sample_next(logits, SamplingParams(), [None, None])


# --------------------------------------------------------------------------- #
# SamplingParams
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("ok", 3)}, "stop"),
        ({"stop": 7}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_sampling_params_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_to_tuples_and_stay_hashable():
    a = SamplingParams(stop="\n", stop_token_ids=[3, 4], seed=7, min_p=0.1, ignore_eos=True)
    b = SamplingParams(stop=("\n",), stop_token_ids=(3, 4), seed=7, min_p=0.1, ignore_eos=True)
    assert a.stop == ("\n",) and a.stop_token_ids == (3, 4)
    assert a == b and {a: 1}[b] == 1
    assert SamplingParams(stop=["x", "yz"]).stop == ("x", "yz")
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=7) != SamplingParams(seed=8)


# --------------------------------------------------------------------------- #
# generate_batch with per-row params
# --------------------------------------------------------------------------- #


ROW_PARAMS = [
    SamplingParams(temperature=0, max_new_tokens=6),
    SamplingParams(temperature=0.8, max_new_tokens=9, seed=11),
    SamplingParams(temperature=1.2, top_k=10, top_p=0.9, max_new_tokens=5, seed=12),
    SamplingParams(temperature=0, max_new_tokens=3),
    SamplingParams(temperature=1.0, min_p=0.9, max_new_tokens=7, seed=13, stop_token_ids=(40, 41, 42)),
    SamplingParams(temperature=0.8, max_new_tokens=9, seed=11),  # same as row 1: same tokens for its prompt
]


def test_per_row_params_in_one_batch_equal_each_row_alone(model, tokenizer, prompts):
    eos, pad = {tokenizer.eos_token_id}, tokenizer.pad_token_id
    batched = generate_batch(model, prompts, ROW_PARAMS, eos, pad, _gen(0))
    assert len(batched) == len(prompts)
    for row, (prompt, params, out) in enumerate(zip(prompts, ROW_PARAMS, batched)):
        # Alone, with an unrelated default generator: seeded rows draw from their own seed.
        alone = generate_batch(model, [prompt], params, eos, pad, _gen(999))[0]
        assert out.output_ids == alone.output_ids, row
        assert out.finish_reason == alone.finish_reason and out.matched_stop == alone.matched_stop
        assert len(out.output_logprobs) == len(out.output_ids)
        assert out.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
        if out.finish_reason == "length":
            assert len(out.output_ids) == params.max_new_tokens and out.matched_stop is None
        else:
            assert out.output_ids[-1] in set(params.stop_token_ids) | eos
            assert out.matched_stop == out.output_ids[-1]
    # Two rows with the same prompt, settings and seed draw the same tokens: those row 1 drew above.
    swapped = generate_batch(model, [prompts[0], prompts[1], prompts[1]],
                             [ROW_PARAMS[0], ROW_PARAMS[1], ROW_PARAMS[5]], eos, pad, _gen(3))
    assert swapped[1].output_ids == swapped[2].output_ids == batched[1].output_ids


def test_per_row_max_new_tokens(model, tokenizer, prompts):
    eos, pad = {tokenizer.eos_token_id}, tokenizer.pad_token_id
    limits = [2, 5, 3, 1, 5, 4]
    params = [SamplingParams(temperature=0, max_new_tokens=k) for k in limits]
    outs = generate_batch(model, prompts, params, eos, pad)
    longest = generate_batch(model, prompts, SamplingParams(temperature=0, max_new_tokens=5), eos, pad)
    for out, full, limit in zip(outs, longest, limits):
        assert out.finish_reason == "length" and len(out.output_ids) == limit
        assert out.output_ids == full.output_ids[:limit]
        assert out.output_logprobs == pytest.approx(full.output_logprobs[:limit], abs=1e-5)


def test_make_generators():
    default = _gen(0)
    unseeded = [SamplingParams(), SamplingParams(temperature=0)]
    assert make_generators(unseeded, default) is default
    assert make_generators(unseeded, None) is None
    mixed = [SamplingParams(seed=5), SamplingParams(), SamplingParams(seed=5)]
    gens = make_generators(mixed, default)
    assert len(gens) == 3 and gens[1] is default and gens[0] is not gens[2]
    assert torch.equal(torch.rand(4, generator=gens[0]), torch.rand(4, generator=_gen(5)))
    assert torch.equal(torch.rand(4, generator=gens[2]), torch.rand(4, generator=_gen(5)))
    assert make_generators(mixed, None)[1] is None


def test_generate_batch_rejects_mismatched_lists(model, tokenizer, prompts):
    eos, pad = {tokenizer.eos_token_id}, tokenizer.pad_token_id
    with pytest.raises(ValueError, match="params"):
        generate_batch(model, prompts, [SamplingParams()] * 2, eos, pad)
    with pytest.raises(ValueError, match="generator"):
        generate_batch(model, prompts, SamplingParams(), eos, pad, [None])
    with pytest.raises(ValueError, match="decode"):
        generate_batch(model, prompts, SamplingParams(stop=("x",)), eos, pad)


def test_explicit_generator_list_is_used_as_given(model, tokenizer, prompts):
    eos, pad = {tokenizer.eos_token_id}, tokenizer.pad_token_id
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)  # seed not consulted with a list
    a = generate_batch(model, prompts[:2], params, eos, pad, [_gen(7), _gen(8)])
    b = generate_batch(model, prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=4), eos, pad,
                       [_gen(7), _gen(8)])
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    alone = generate_batch(model, prompts[1:2], SamplingParams(temperature=1.0, max_new_tokens=4), eos, pad, _gen(8))
    assert a[1].output_ids == alone[0].output_ids


# --------------------------------------------------------------------------- #
# eos, stop strings, abort (scripted logits)
# --------------------------------------------------------------------------- #


def test_ignore_eos_keeps_generating_but_stop_ids_still_stop(tokenizer):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    scripts = [[13, eos, 14, 15, 16, 17], [13, eos, 14, 15, 16, 17], [13, eos, 14, 15, 16, 17]]
    params = [SamplingParams(temperature=0, max_new_tokens=5),
              SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True, stop_token_ids=(15,))]
    fake = ScriptedModel(scripts, vocab)
    outs = generate_batch(fake, [[13], [13], [13]], params, {eos}, tokenizer.pad_token_id)
    assert outs[0].output_ids == [13, eos] and outs[0].finish_reason == "stop" and outs[0].matched_stop == eos
    assert outs[1].output_ids == [13, eos, 14, 15, 16]
    assert outs[1].finish_reason == "length" and outs[1].matched_stop is None
    assert outs[2].output_ids == [13, eos, 14, 15] and outs[2].finish_reason == "stop" and outs[2].matched_stop == 15
    assert all(len(o.output_logprobs) == len(o.output_ids) for o in outs)
    # Finished rows are fed the pad token; the loop stops once every row is done (1 prefill + 4 steps).
    assert len(fake.calls) == 5
    assert [int(t) for t in fake.calls[2][:, 0]] == [tokenizer.pad_token_id, eos, eos]


def test_ignore_eos_with_the_tiny_model_runs_to_max_new_tokens(model, tokenizer, prompts):
    pad = tokenizer.pad_token_id
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    free = generate_batch(model, prompts, greedy, {tokenizer.eos_token_id}, pad)
    # Declare row 0's second greedy token the eos: rows that ignore it run to their limit regardless.
    eos = {free[0].output_ids[1]}
    params = [SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=row % 2 == 0) for row in range(len(prompts))]
    outs = generate_batch(model, prompts, params, eos, pad)
    assert outs[0].output_ids == free[0].output_ids and outs[0].finish_reason == "length"
    for row, (out, ref) in enumerate(zip(outs, free)):
        if row % 2 == 0 or not eos & set(ref.output_ids):
            assert out.output_ids == ref.output_ids and out.finish_reason == "length"
        else:
            cut = next(i for i, t in enumerate(ref.output_ids) if t in eos) + 1
            assert out.output_ids == ref.output_ids[:cut] and out.finish_reason == "stop"


def test_stop_string_ends_the_row_and_cuts_the_text(tokenizer):
    text = "abc\nEND more text"
    script = tokenizer.encode(text)
    params = [
        SamplingParams(temperature=0, max_new_tokens=16, stop=("END",)),
        SamplingParams(temperature=0, max_new_tokens=16, stop=("zzz", "c\nE", "\n")),  # earliest occurrence wins
        SamplingParams(temperature=0, max_new_tokens=5, stop=("zzz",)),
        SamplingParams(temperature=0, max_new_tokens=5),
        SamplingParams(temperature=0.9, top_k=1, max_new_tokens=16, stop=("ore",), seed=3),
    ]
    fake = ScriptedModel([script] * len(params), len(tokenizer))
    outs = generate_batch(fake, [[13]] * len(params), params, {tokenizer.eos_token_id}, tokenizer.pad_token_id,
                          decode=_decode(tokenizer))
    # Every generated token is kept (the stop string's too); only the text stops before it.
    assert outs[0].output_ids == script[: len("abc\nEND")]
    assert outs[0].finish_reason == "stop" and outs[0].matched_stop == "END" and outs[0].text == "abc\n"
    # "\n" completes at the 4th token, before "c\nE" does.
    assert outs[1].output_ids == script[:4] and outs[1].matched_stop == "\n" and outs[1].text == "abc"
    assert outs[2].output_ids == script[:5] and outs[2].finish_reason == "length"
    assert outs[2].matched_stop is None and outs[2].text == "abc\nE"
    assert outs[3].text == "abc\nE" and outs[3].finish_reason == "length"
    assert outs[4].output_ids == script[: len("abc\nEND more")] and outs[4].text == "abc\nEND m"
    assert outs[4].matched_stop == "ore"
    for out in outs:
        assert len(out.output_logprobs) == len(out.output_ids)
        assert tokenizer.decode(out.output_ids).startswith(out.text)
    # Without a decoder, outputs carry no text.
    plain = generate_batch(ScriptedModel([script], len(tokenizer)), [[13]],
                           SamplingParams(temperature=0, max_new_tokens=3), {tokenizer.eos_token_id},
                           tokenizer.pad_token_id)
    assert plain[0].text is None


def test_stop_token_wins_over_stop_string_and_length(tokenizer):
    eos = tokenizer.eos_token_id
    script = tokenizer.encode("ab") + [eos]
    fake = ScriptedModel([script, script], len(tokenizer))
    outs = generate_batch(fake, [[13], [13]],
                          [SamplingParams(temperature=0, max_new_tokens=3, stop=("<eos>",)),
                           SamplingParams(temperature=0, max_new_tokens=3)],
                          {eos}, tokenizer.pad_token_id, decode=_decode(tokenizer))
    for out in outs:
        assert out.output_ids == script and out.finish_reason == "stop" and out.matched_stop == eos


def test_abort_keeps_what_each_row_produced(tokenizer):
    vocab = len(tokenizer)
    scripts = [list(range(10, 30))] * 4
    params = [SamplingParams(temperature=0, max_new_tokens=8),
              SamplingParams(temperature=0, max_new_tokens=8),
              SamplingParams(temperature=0, max_new_tokens=2),
              SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(12,))]
    calls: list[int] = []

    def should_abort() -> set[int]:
        step = len(calls)
        calls.append(step)
        # Row 1 at step 3; rows 2 and 3 (already finished at steps 1 and 2) are named at step 4: no effect.
        return {1} if step == 3 else {2, 3} if step == 4 else set()

    fake = ScriptedModel(scripts, vocab)
    outs = generate_batch(fake, [[13]] * 4, params, {tokenizer.eos_token_id}, tokenizer.pad_token_id,
                          should_abort=should_abort)
    assert outs[1].finish_reason == "abort" and outs[1].matched_stop is None
    assert outs[1].output_ids == list(range(10, 14))  # aborted at step 3: 3 + 1 tokens
    assert len(outs[1].output_logprobs) == 4
    assert outs[0].output_ids == list(range(10, 18)) and outs[0].finish_reason == "length"
    assert outs[2].output_ids == [10, 11] and outs[2].finish_reason == "length"
    assert outs[3].output_ids == [10, 11, 12] and outs[3].finish_reason == "stop" and outs[3].matched_stop == 12
    # Called once per step while a row runs (steps 0..6; at step 7 every row has finished).
    assert calls == list(range(7))


def test_abort_every_row_ends_the_loop_and_bad_rows_raise(tokenizer):
    vocab = len(tokenizer)
    fake = ScriptedModel([list(range(10, 30))] * 3, vocab)
    outs = generate_batch(fake, [[13]] * 3, SamplingParams(temperature=0, max_new_tokens=10), set(),
                          tokenizer.pad_token_id, should_abort=lambda: {0, 1, 2})
    assert [o.output_ids for o in outs] == [[10]] * 3 and {o.finish_reason for o in outs} == {"abort"}
    assert len(fake.calls) == 1  # only the prefill: no decode step after the abort
    with pytest.raises(ValueError, match="row 3"):
        generate_batch(ScriptedModel([[10] * 5] * 3, vocab), [[13]] * 3,
                       SamplingParams(temperature=0, max_new_tokens=4), set(), tokenizer.pad_token_id,
                       should_abort=lambda: [3])


def test_generate_output_defaults_keep_old_constructor():
    out = GenerateOutput([1, 2], [-0.5, -0.25], "length")
    assert out.matched_stop is None and out.text is None
