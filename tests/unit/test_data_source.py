"""Tests for JSONL prompt loading and the epoch-based DataSource."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tether.models.tiny import build_char_tokenizer
from tether.rollout.prompt_format import PromptFormat
from tether.rollout.data_source import DataSource, DatasetError, PromptRow, load_prompt_rows
from tether.sample import Sample


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def write_jsonl(path: Path, objs: list) -> Path:
    path.write_text("\n".join(json.dumps(o) for o in objs) + "\n", encoding="utf-8")
    return path


def make_rows(n: int) -> list[PromptRow]:
    return [
        PromptRow(index=i, line=i + 1, prompt=f"p{i}", label=str(i), metadata={"i": i},
                  prompt_ids=[i])
        for i in range(n)
    ]


# ---------------------------------------------------------------- loading


def test_load_basic_fields_and_defaults(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+1=?", "label": "2", "metadata": {"src": "a"}},
        {"prompt": "abc"},
    ])
    rows, filtered, _ = load_prompt_rows(path, tok)
    assert filtered == 0
    assert [r.index for r in rows] == [0, 1]
    assert [r.line for r in rows] == [1, 2]
    assert rows[0].label == "2" and rows[0].metadata == {"src": "a"}
    assert rows[1].label is None and rows[1].metadata == {}
    # Char tokenizer: one token per character, no special tokens added.
    assert rows[0].prompt_ids == tok.encode("1+1=?", add_special_tokens=False)
    assert len(rows[0].prompt_ids) == 5


def test_custom_keys_and_blank_lines(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"q": "hi", "a": 3, "m": {"k": 1}}) + "\n\n   \n"
        + json.dumps({"q": "yo", "a": 4}) + "\n",
        encoding="utf-8",
    )
    rows, _, _ = load_prompt_rows(path, tok, prompt_key="q", label_key="a", metadata_key="m")
    assert [(r.prompt, r.label, r.line) for r in rows] == [("hi", 3, 1), ("yo", 4, 4)]
    assert rows[0].metadata == {"k": 1}


def test_chat_template_string_and_messages(tmp_path, tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2*3"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hello"}, {"prompt": messages}])
    rows, _, _ = load_prompt_rows(path, tok, fmt=PromptFormat(apply_chat_template=True))
    assert tok.decode(rows[0].prompt_ids) == "user: hello\nassistant: "
    assert tok.decode(rows[1].prompt_ids) == "system: be brief\nuser: 2*3\nassistant: "
    assert rows[1].prompt == messages  # raw prompt kept as in the data


def test_messages_without_chat_template_is_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "ok"}, {"prompt": [{"role": "user", "content": "x"}]},
    ])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: .*apply_chat_template"):
        load_prompt_rows(path, tok)


def test_tokenizer_without_template_is_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}])
    with pytest.raises(DatasetError, match="chat_template"):
        load_prompt_rows(path, build_char_tokenizer(chat_template=False), fmt=PromptFormat(apply_chat_template=True))


def test_length_filtering_counts_and_reindexes(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "a" * 10}, {"prompt": "b" * 3}, {"prompt": "c" * 4}, {"prompt": "d" * 5},
    ])
    rows, filtered, _ = load_prompt_rows(path, tok, max_prompt_len=4)
    assert filtered == 2
    assert [r.prompt for r in rows] == ["bbb", "cccc"]
    assert [r.index for r in rows] == [0, 1]
    assert [r.line for r in rows] == [2, 3]


def test_everything_filtered_is_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "long prompt"}])
    with pytest.raises(DatasetError, match="max_prompt_len=3"):
        load_prompt_rows(path, tok, max_prompt_len=3)


def test_bad_json_names_file_and_line(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"bad\.jsonl:3: invalid JSON"):
        load_prompt_rows(path, tok)


def test_missing_prompt_key_lists_keys(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"question": "b", "answer": 1}])
    with pytest.raises(DatasetError) as info:
        load_prompt_rows(path, tok)
    msg = str(info.value)
    assert "d.jsonl:2" in msg and "'prompt'" in msg
    assert "answer" in msg and "question" in msg


def test_bad_field_types(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "metadata": [1]}])
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: field 'metadata'"):
        load_prompt_rows(path, tok)
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": 5}])
    with pytest.raises(DatasetError, match=r"e\.jsonl:1: field 'prompt'"):
        load_prompt_rows(path, tok)
    path = write_jsonl(tmp_path / "f.jsonl", [[1, 2]])
    with pytest.raises(DatasetError, match=r"f\.jsonl:1: expected a JSON object"):
        load_prompt_rows(path, tok)


def test_missing_and_empty_file(tmp_path, tok):
    with pytest.raises(DatasetError, match="not found"):
        load_prompt_rows(tmp_path / "nope.jsonl", tok)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(DatasetError, match="no rows"):
        load_prompt_rows(empty, tok)


# ---------------------------------------------------------------- DataSource


def test_no_shuffle_order_and_epoch_rollover():
    ds = DataSource(make_rows(5), prompts_per_rollout=2, n_samples_per_prompt=1,
                    shuffle=False, seed=0)
    assert ds.num_rollout_per_epoch == 2
    seen = [[r.index for r in ds.next_prompts()] for _ in range(2)]
    assert seen == [[0, 1], [2, 3]]  # row 4 is the dropped remainder
    assert ds.epoch == 1
    assert [r.index for r in ds.next_prompts()] == [0, 1]
    assert ds.state_dict() == {"epoch": 1, "offset": 2, "seed": 0, "num_rows": 5}


def test_shuffle_is_deterministic_and_changes_per_epoch():
    def epochs(seed: int) -> list[list[int]]:
        ds = DataSource(make_rows(12), prompts_per_rollout=4, n_samples_per_prompt=1,
                        shuffle=True, seed=seed)
        return [sum((([r.index for r in ds.next_prompts()]) for _ in range(3)), [])
                for _ in range(3)]

    a, b = epochs(7), epochs(7)
    assert a == b
    assert all(sorted(e) == list(range(12)) for e in a)  # permutation, no drops here
    assert a[0] != a[1]
    assert epochs(8) != a


def test_shuffle_drops_remainder_each_epoch():
    rows = make_rows(7)
    ds = DataSource(rows, prompts_per_rollout=3, n_samples_per_prompt=1, shuffle=True, seed=1)
    assert ds.num_rollout_per_epoch == 2
    for epoch in range(3):
        assert ds.epoch == epoch
        got = [r.index for _ in range(2) for r in ds.next_prompts()]
        assert len(set(got)) == 6  # one row skipped, no repeats within the epoch
    assert ds.epoch == 3


def test_too_few_rows_is_error():
    with pytest.raises(ValueError, match="fewer than prompts_per_rollout=4"):
        DataSource(make_rows(3), prompts_per_rollout=4, n_samples_per_prompt=1,
                   shuffle=False, seed=0)


def test_state_dict_round_trip_reproduces_next_prompts():
    kwargs = dict(prompts_per_rollout=3, n_samples_per_prompt=2, shuffle=True, seed=3)
    ds = DataSource(make_rows(10), **kwargs)
    for _ in range(4):  # crosses an epoch boundary (3 rollouts per epoch)
        ds.next_prompts()
    state = ds.state_dict()
    expected = [[r.index for r in ds.next_prompts()] for _ in range(5)]

    resumed = DataSource(make_rows(10), **kwargs)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.epoch == state["epoch"] == 1
    assert [[r.index for r in resumed.next_prompts()] for _ in range(5)] == expected


def test_load_state_dict_refuses_mismatch():
    ds = DataSource(make_rows(6), prompts_per_rollout=2, n_samples_per_prompt=1,
                    shuffle=True, seed=0)
    with pytest.raises(ValueError, match="num_rows=7"):
        ds.load_state_dict({"epoch": 0, "offset": 0, "seed": 0, "num_rows": 7})
    with pytest.raises(ValueError, match="seed=5"):
        ds.load_state_dict({"epoch": 0, "offset": 0, "seed": 5, "num_rows": 6})
    with pytest.raises(ValueError, match="missing keys"):
        ds.load_state_dict({"epoch": 0})


def test_next_samples_grouping():
    ds = DataSource(make_rows(4), prompts_per_rollout=2, n_samples_per_prompt=3,
                    shuffle=False, seed=0)
    samples = ds.next_samples()
    assert all(isinstance(s, Sample) for s in samples)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert samples[3].prompt == "p1" and samples[3].label == "1"
    assert samples[3].metadata == {"i": 1} and samples[3].prompt_ids == [1]
    # Each sample owns its mutable fields.
    samples[0].metadata["x"] = 1
    samples[0].prompt_ids.append(9)
    assert samples[1].metadata == {"i": 0} and samples[1].prompt_ids == [0]
    assert samples[0].response_ids == [] and samples[0].reward is None
    assert [s.prompt_index for s in ds.next_samples()][::3] == [2, 3]


def test_sample_to_dict_is_json_safe():
    s = Sample(prompt_index=1, sample_index=2, prompt=[{"role": "user", "content": "x"}],
               label="3", metadata={"a": 1}, prompt_ids=[4, 5], response_ids=[6],
               response_logprobs=[float("-inf")], response_text="y", finish_reason="stop",
               reward=1.0)
    d = json.loads(json.dumps(s.to_dict(), allow_nan=False))
    assert d["response_length"] == 1 and d["response_logprobs"] == [None]
    assert d["prompt"] == [{"role": "user", "content": "x"}] and d["reward"] == 1.0


# ---------------------------------------------------------------- Parquet


def test_parquet_rows_load_as_their_jsonl_twins(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [{"role": "user", "content": "2*3"}]
    objs = [{"prompt": messages, "label": "6", "metadata": {"src": "a"}},
            {"prompt": [{"role": "user", "content": "hi"}], "label": "x", "metadata": None}]
    pq.write_table(pa.Table.from_pylist(objs), tmp_path / "d.parquet")
    fmt = PromptFormat(apply_chat_template=True)
    from_parquet, _, _ = load_prompt_rows(tmp_path / "d.parquet", tok, fmt=fmt)
    from_jsonl, _, _ = load_prompt_rows(write_jsonl(tmp_path / "d.jsonl", objs), tok, fmt=fmt)
    assert from_parquet == from_jsonl and from_parquet[0].prompt == messages
    assert from_parquet[1].metadata == {}


def test_a_bad_parquet_row_is_named_by_its_row(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "label": "1"}, {"prompt": None, "label": "2"}]),
                   tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d\.parquet row 2: .*prompt"):
        load_prompt_rows(tmp_path / "d.parquet", tok)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"bad\.parquet: not a readable Parquet file"):
        load_prompt_rows(tmp_path / "bad.parquet", tok)


def test_sft_rows_read_parquet_too(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import tiny_config
    from tether.config import config_from_dict
    from tether.sft.run import load_sft_rows

    objs = [{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2=", "response": "4"}]
    pq.write_table(pa.Table.from_pylist(objs), tmp_path / "sft.parquet")
    data = {"train": write_jsonl(tmp_path / "t.jsonl", [{"prompt": "x"}]), "eval": tmp_path / "t.jsonl"}
    raw = tiny_config(tmp_path, data, tmp_path / "out", sft={"path": str(tmp_path / "sft.parquet")})
    rows = load_sft_rows(config_from_dict(raw), tok)
    assert rows == [(tok.encode("1+1=", add_special_tokens=False), tok.encode("2", add_special_tokens=False)
                     + [tok.eos_token_id]), (tok.encode("2+2=", add_special_tokens=False),
                                             tok.encode("4", add_special_tokens=False) + [tok.eos_token_id])]
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "response": 3}]), tmp_path / "sft.parquet")
    with pytest.raises(DatasetError, match=r"sft\.parquet row 1: field 'response' must be a string"):
        load_sft_rows(config_from_dict(raw), tok)


def test_a_row_without_metadata_gives_its_other_fields(tmp_path, tok):
    """TRL, verl and SkyRL datasets keep what rewards and environments need in columns of their own."""
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+1=?", "answer": "2", "task": "add", "reward_model": {"ground_truth": "2", "style": "rule"}},
        {"prompt": "2+2=?", "answer": "4", "metadata": {"src": "b"}, "task": "add"},
        {"prompt": "3+3=?", "answer": "6", "metadata": None},
    ])
    rows, _, _ = load_prompt_rows(path, tok, label_key="reward_model.ground_truth")
    assert rows[0].label == "2" and rows[0].metadata == {"answer": "2", "task": "add"}  # the label's field left out
    assert rows[1].metadata == {"src": "b"}  # a metadata field is the metadata, as before
    assert rows[2].metadata == {}
