"""Incremental detokenization equals decoding the whole response, with a real BPE vocabulary
(SmolLM2's 49,152 tokens) and the character tokenizer; stop strings found through it."""

from __future__ import annotations

import random

import pytest

from tether.engine.detokenize import IncrementalDetokenizer
from tether.engine.generate import Sequence
from tether.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def bpe(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _texts_agree(tokenizer, ids: list[int]) -> None:
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731 (as the engine decodes)
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == detok.text
    full = decode(ids)
    # the last token may end inside a character: the incremental text holds back only that
    assert full == detok.text or (full.endswith("\ufffd") and full.startswith(detok.text))


def test_real_text_in_many_scripts(bpe):
    text = ("The GCD of 841 and 549 is 1.\n  Indented  code: x = f(y) -> z\n"
            "Ünïcödé: naïve café, 東京, Привет, 🙂👍🏽, عربى, \\boxed{42}  ")
    _texts_agree(bpe, bpe.encode(text, add_special_tokens=False))
    chat = bpe.apply_chat_template([{"role": "user", "content": text}], tokenize=True, return_dict=False)
    _texts_agree(bpe, chat)  # special tokens (skipped) in the middle


def test_random_token_streams(bpe):
    rng = random.Random(0)
    for _ in range(20):
        _texts_agree(bpe, [rng.randrange(len(bpe)) for _ in range(rng.randint(1, 60))])


def test_character_tokenizer(tokenizer):
    _texts_agree(tokenizer, tokenizer.encode("37+48=85\nrev:abc", add_special_tokens=False))


def test_stop_strings_with_bpe_tokens(bpe):
    decode = lambda t: bpe.decode(t, skip_special_tokens=True)  # noqa: E731
    ids = bpe.encode("Step 1: add.\nThe answer is 42.\n\nQuestion: next", add_special_tokens=False)
    params = SamplingParams(stop=("\n\n", "answer is 4"), max_new_tokens=100)
    seq = Sequence(0, [1], params, 0, frozenset())
    for token in ids:
        seq.record(token, -0.1, decode)
        if seq.finish_reason:
            break
    assert seq.finish_reason == "stop" and seq.matched == "answer is 4"
    out = seq.output(decode)
    assert out.text == "Step 1: add.\nThe "  # cut right before the stop string
    assert decode(out.output_ids).startswith(out.text + "answer is 4")  # every generated token kept
