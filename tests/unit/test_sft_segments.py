"""SFT rows whose response is a list of segments: `"train": false` segments (a tool's output) are in
the input but never a target; malformed segments are errors naming the file, the line and the field;
a plain string response loads exactly as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from tether.trainer.batch import collate
from tether.config import config_from_dict
from tether.rollout.prompt_format import DatasetError
from tether.sft.run import batches, load_sft_rows
from tether.models.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(chat_template=False)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def load(tmp_path: Path, tok, objs: list, **sft) -> list[tuple]:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    train = tmp_path / "t.jsonl"
    train.write_text(json.dumps({"prompt": "x"}) + "\n")
    raw = tiny_config(tmp_path, {"train": train, "eval": train}, tmp_path / "out", sft={"path": str(path), **sft})
    return load_sft_rows(config_from_dict(raw), tok)


TOOL_ROW = {"prompt": "347*58=", "response": [{"text": "<calc>347*58</calc>"},
                                               {"text": "<result>20126</result>", "train": False},
                                               {"text": "20126"}]}


def test_untrained_segments_are_input_only(tmp_path, tok):
    [(prompt, response, mask)] = load(tmp_path, tok, [TOOL_ROW])
    assert prompt == ids(tok, "347*58=")
    assert response == ids(tok, "<calc>347*58</calc><result>20126</result>20126") + [tok.eos_token_id]
    call, result, answer = len("<calc>347*58</calc>"), len("<result>20126</result>"), len("20126")
    assert mask == [1] * call + [0] * result + [1] * answer + [1]  # the eos is always a target
    assert len(mask) == len(response)


def test_plain_strings_and_all_trained_segments_load_as_before(tmp_path, tok):
    rows = load(tmp_path, tok, [{"prompt": "1+1=", "response": "2"},
                                {"prompt": "2+2=", "response": [{"text": "<calc>2+2</calc>", "train": True},
                                                                {"text": "4"}]}])
    assert rows == [(ids(tok, "1+1="), ids(tok, "2") + [tok.eos_token_id]),
                    (ids(tok, "2+2="), ids(tok, "<calc>2+2</calc>4") + [tok.eos_token_id])]
    # Without a masked row a batch has no loss masks at all, exactly as before segments existed.
    assert all(b.loss_masks is None for b in batches(rows, 2, 2, seed=0))


def test_a_batch_masks_the_tool_output_and_nothing_else(tmp_path, tok):
    rows = load(tmp_path, tok, [{"prompt": "1+1=", "response": "2"}, TOOL_ROW])
    [batch] = list(batches(rows, 2, 1, seed=0))
    batch.validate()
    by_prompt = {len(t) - r: m for t, r, m in zip(batch.tokens, batch.response_lengths, batch.loss_masks)}
    assert by_prompt[len("1+1=")] == [1, 1]
    tool_mask = by_prompt[len("347*58=")]
    assert sum(1 for m in tool_mask if m == 0) == len("<result>20126</result>")
    # The trainer's tensors: the masked tokens are never a target (their predictions carry no loss).
    mb = collate(batch, [0, 1], pad_id=tok.pad_token_id)
    tool_row = [i for i, t in enumerate(batch.tokens) if len(t) - batch.response_lengths[i] == len("347*58=")][0]
    trained = mb.response_mask[tool_row].sum().item()
    assert trained == len("<calc>347*58</calc>") + len("20126") + 1
    assert batch.trained_tokens(tool_row) == trained


@pytest.mark.parametrize("response, message", [
    (3, r"field 'response' must be a string or a list of segments .*got int"),
    ([], r"field 'response' is an empty list of segments"),
    (["<calc>1</calc>"], r"field 'response\[0\]' must be an object .*got str"),
    ([{"text": "a"}, {"txt": "b"}], r"field 'response\[1\]' has unknown key\(s\) 'txt'"),
    ([{"train": False}], r"field 'response\[0\]\.text' must be a string, got nothing"),
    ([{"text": 5}], r"field 'response\[0\]\.text' must be a string, got int"),
    ([{"text": "a", "train": "no"}], r"field 'response\[0\]\.train' must be true or false, got 'no'"),
    ([{"text": "a", "train": 0}], r"field 'response\[0\]\.train' must be true or false, got 0"),
])
def test_malformed_segments_name_file_line_and_field(tmp_path, tok, response, message):
    with pytest.raises(DatasetError, match=r"sft\.jsonl:2: " + message):
        load(tmp_path, tok, [{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2=", "response": response}])


def test_the_response_key_names_the_field(tmp_path, tok):
    with pytest.raises(DatasetError, match=r"sft\.jsonl:1: field 'answer\[0\]\.train'"):
        load(tmp_path, tok, [{"prompt": "1=", "answer": [{"text": "1", "train": 1.5}]}], response_key="answer")


def test_parquet_segments_with_a_missing_train_key(tmp_path, tok):
    """Parquet writes null for a key only other segments have: null is 'not given' (trained on)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([TOOL_ROW]), tmp_path / "sft.parquet")
    train = tmp_path / "t.jsonl"
    train.write_text(json.dumps({"prompt": "x"}) + "\n")
    raw = tiny_config(tmp_path, {"train": train, "eval": train}, tmp_path / "out",
                      sft={"path": str(tmp_path / "sft.parquet")})
    [(_, _, mask)] = load_sft_rows(config_from_dict(raw), tok)
    assert mask == [1] * 19 + [0] * 22 + [1] * 6
