"""data.prompt_template, data.response_prefix and the tokenizer round-trip check."""

from __future__ import annotations

import json

import pytest

from tether.config import ConfigError, config_from_dict
from tether.rollout.data_source import load_prompt_rows
from tether.rollout.prompt_format import DatasetError, PromptFormat, round_trip_problems


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_template_and_prefix_shape_the_encoded_prompt(tmp_path, tokenizer):
    path = write(tmp_path / "d.jsonl", [{"prompt": "3 1 2", "label": "1 2 3", "op": "sort"}])
    fmt = PromptFormat(template="{op}: {prompt} =", response_prefix=" ")
    (row,), _, _ = load_prompt_rows(path, tokenizer, fmt=fmt)
    assert row.text == "sort: 3 1 2 = " and tokenizer.decode(row.prompt_ids) == row.text
    assert row.prompt == "3 1 2"  # the raw prompt stays as in the data (rewards see it)


def test_template_goes_inside_the_chat_template(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2*3"}]
    path = write(tmp_path / "d.jsonl", [{"prompt": messages}, {"prompt": "4*5"}])
    fmt = PromptFormat(apply_chat_template=True, template="{prompt} =", response_prefix="so ")
    rows, _, _ = load_prompt_rows(path, tokenizer, fmt=fmt)
    assert rows[0].text == "system: be brief\nuser: 2*3 =\nassistant: so "
    assert rows[1].text == "user: 4*5 =\nassistant: so "
    assert messages[1]["content"] == "2*3"


def test_template_naming_a_missing_field_names_the_line(tmp_path, tokenizer):
    path = write(tmp_path / "d.jsonl", [{"prompt": "a", "op": "x"}, {"prompt": "b"}])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: data.prompt_template .* names field 'op'"):
        load_prompt_rows(path, tokenizer, fmt=PromptFormat(template="{op} {prompt}"))


@pytest.mark.parametrize("template, message", [
    ("no field", "has no field"),
    ("\\boxed{} {prompt}", "literal braces are doubled"),
    ("{prompt", "not a valid template"),
])
def test_bad_templates_are_config_errors(template, message):
    with pytest.raises(ConfigError, match="data.prompt_template") as err:
        config_from_dict({"model": {"path": "m"}, "data": {"prompt_template": template}})
    assert message in str(err.value)


def test_literal_braces_survive(tmp_path, tokenizer):
    cfg = config_from_dict({"model": {"path": "m"}, "data": {"prompt_template": "{prompt} in \\boxed{{}}"}})
    path = write(tmp_path / "d.jsonl", [{"prompt": "1+1"}])
    (row,), _, _ = load_prompt_rows(path, tokenizer, fmt=PromptFormat.from_config(cfg.data))
    assert row.text == "1+1 in \\boxed{}"


class SpaceDropping:
    """What a word-level tokenizer loaded as a byte-level one did: spaces vanish."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text if c != " "]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_round_trip_names_the_row_and_shows_both_strings(tokenizer):
    items = [("d.jsonl:1", "prompt", "12="), ("d.jsonl:2", "prompt", "add 1 2 ="), ("d.jsonl:2", "label", "1 2")]
    assert round_trip_problems(tokenizer, items) == []
    (warning,) = round_trip_problems(SpaceDropping(), items)
    assert warning.startswith("2 checked text(s) do not survive the tokenizer")
    assert "d.jsonl:2 prompt: 'add 1 2 =' comes back as 'add12='" in warning
    assert "d.jsonl:2 label: '1 2' comes back as '12'" in warning
