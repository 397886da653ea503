"""Chat-format SFT rows (TRL's conversational format): rendered with the model's own chat template,
trained on the assistant turns only, with a real BPE tokenizer and template (SmolLM2's)."""

from __future__ import annotations

import json

import pytest

from tether.config import config_from_dict
from tether.rollout.prompt_format import DatasetError
from tether.sft.data import conversation_ids, load_sft_rows

CONVERSATION = [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "What is 17 + 25?"},
                {"role": "assistant", "content": "42"},
                {"role": "user", "content": "And times 2?"},
                {"role": "assistant", "content": "84"}]


@pytest.fixture(scope="module")
def bpe(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_assistant_turns_are_the_targets(bpe):
    prompt, response, mask = conversation_ids(bpe, CONVERSATION, "row 1", "messages")
    whole = bpe.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert prompt + response == list(whole)  # exactly the template's tokens, nothing re-tokenized
    trained = bpe.decode([t for t, m in zip(response, mask) if m])
    assert trained == "42<|im_end|>\n84<|im_end|>\n"  # each answer and its end-of-turn, nothing else
    assert bpe.decode(prompt).endswith("<|im_start|>assistant\n")
    assert "And times 2?" in bpe.decode([t for t, m in zip(response, mask) if not m])


def test_trailing_user_turn_is_dropped_and_single_turn_has_no_mask(bpe):
    prompt, response, mask = conversation_ids(bpe, CONVERSATION[:3] + [CONVERSATION[3]], "row 1", "messages")
    assert all(mask) and bpe.decode(response) == "42<|im_end|>\n"


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ([{"role": "assistant", "content": "hi"}], r"messages\[0\]' is an assistant message"),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}], r"messages\[1\]' must be"),
    ([{"role": "user", "content": 3}], r"messages\[0\]' must be"),
])
def test_bad_conversations_name_the_row_and_field(bpe, messages, match):
    with pytest.raises(DatasetError, match=match):
        conversation_ids(bpe, messages, "data.jsonl:7", "messages")


def test_rows_of_both_kinds_in_one_file(tmp_path, smollm2_dir, bpe):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n"
                    + json.dumps({"prompt": "What is 2 + 2?", "response": "4"}) + "\n")
    cfg = config_from_dict({"model": {"path": str(smollm2_dir)}, "sft": {"path": str(path)},
                            "data": {"apply_chat_template": True}})
    rows = load_sft_rows(cfg, bpe)
    assert len(rows) == 2 and len(rows[0]) == 3 and len(rows[1]) == 2  # the conversation has a loss mask
    assert bpe.decode(rows[1][1]) == "4<|im_end|>"  # prompt/response rows: the response and the eos


def test_a_tokenizer_without_a_chat_template_is_refused(tokenizer):
    plain = tokenizer
    saved = plain.chat_template
    plain.chat_template = None
    try:
        with pytest.raises(DatasetError, match="no chat template"):
            conversation_ids(plain, CONVERSATION, "sft.jsonl:1", "messages")
    finally:
        plain.chat_template = saved
