"""The offline tokenizer: saved next to a Qwen2 config, it loads back as the same tokenizer."""

from __future__ import annotations

from transformers import AutoTokenizer

from tether.models.tiny import CHARS, build_char_tokenizer, build_tiny_model

TEXTS = ["add 1 2 3 =", "max of 4 9 2 is 9\n", "a , b . c ' d  e", "\\boxed{12} <eos>", CHARS]


def test_saved_tokenizer_round_trips_spaces(tmp_path):
    built = build_char_tokenizer()
    build_tiny_model(tmp_path, built, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=16, max_positions=16)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == built.encode(text, add_special_tokens=False)
        assert loaded.decode(ids) == text
    assert (loaded.eos_token_id, loaded.pad_token_id) == (built.eos_token_id, built.pad_token_id)
    assert loaded.apply_chat_template([{"role": "user", "content": "1 2"}], tokenize=False,
                                      add_generation_prompt=True) == "user: 1 2\nassistant: "


def test_one_token_per_character():
    tok = build_char_tokenizer()
    assert len(tok) == len(set(CHARS)) + 3
    assert len(tok.encode("ab 12\n", add_special_tokens=False)) == 6
