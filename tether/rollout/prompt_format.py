"""From a data row to the text the engine sees: the prompt field, a template, the chat template, a
response prefix; and the start-up check that this text survives the tokenizer.

    row {"prompt": "3 1 2", "label": "1 2 3"}
      -> data.prompt_template "sort: {prompt} ="   ->  "sort: 3 1 2 ="
      -> data.apply_chat_template (a string becomes one user message; adds the generation prompt)
      -> + data.response_prefix                    ->  the text that is encoded (no special tokens added)

The same steps serve RL prompts, eval sets and SFT rows, so a model sees one format everywhere.
"""

from __future__ import annotations

import copy
import string
from dataclasses import dataclass
from typing import Any, Iterable

from tether.rollout.row_fields import MISSING, field_value

ROUND_TRIP_ROWS = 32  # rows of each dataset whose texts the start-up check sends through the tokenizer


class DatasetError(ValueError):
    """A dataset is missing, malformed, or unusable; the message names the file and the line."""


@dataclass(frozen=True)
class PromptFormat:
    apply_chat_template: bool = False
    template: str | None = None
    """str.format template over the row's fields; {prompt} is the prompt field (config: data.prompt_template)."""
    response_prefix: str = ""
    """Text put after the (chat-formatted) prompt: the response starts after it (data.response_prefix)."""

    @classmethod
    def from_config(cls, data_cfg: Any) -> PromptFormat:
        return cls(apply_chat_template=data_cfg.apply_chat_template, template=data_cfg.prompt_template,
                   response_prefix=data_cfg.response_prefix)


def template_fields(template: str) -> list[str]:
    """The field names of a str.format template; ValueError (with a hint) when it does not parse."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ValueError(f"{template!r} is not a valid template ({err}); write literal braces doubled, "
                         "e.g. \\boxed{{}}") from None
    if any(name == "" or name.isdigit() for name in fields):
        raise ValueError(f"{template!r}: name each field, e.g. {{prompt}}; an empty {{}} has nothing to fill it "
                         "(literal braces are doubled: \\boxed{{}})")
    return fields


def get_prompt(obj: dict, where: str, prompt_key: str, apply_chat_template: bool) -> str | list[dict]:
    """Extract and validate the prompt field of one row."""
    prompt = field_value(obj, prompt_key)
    if prompt is MISSING:
        raise DatasetError(f"{where}: missing prompt key '{prompt_key}'; keys present: {sorted(obj)}")
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise DatasetError(f"{where}: field '{prompt_key}' must be a string or a list of chat "
                           f"messages, got {type(prompt).__name__}")
    for i, msg in enumerate(prompt):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and "content" in msg):
            raise DatasetError(f"{where}: field '{prompt_key}'[{i}] must be an object with 'role' (string) and 'content'")
    if not apply_chat_template:
        raise DatasetError(f"{where}: field '{prompt_key}' is a list of chat messages, which "
                           f"requires apply_chat_template=True")
    return prompt


def fill_template(fmt: PromptFormat, prompt: str | list[dict], obj: dict, where: str,
                  prompt_key: str) -> str | list[dict]:
    """The prompt with data.prompt_template applied (to the last user message of a conversation)."""
    template = fmt.template
    if template is None:
        return prompt

    def fill(text: str) -> str:
        try:
            return template.format_map({**obj, "prompt": text})
        except KeyError as err:
            raise DatasetError(f"{where}: data.prompt_template {template!r} names field {err}, which this "
                               f"row does not have; keys present: {sorted(obj)}") from None

    if isinstance(prompt, str):
        return fill(prompt)
    messages = copy.deepcopy(prompt)
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise DatasetError(f"{where}: data.prompt_template is set but '{prompt_key}' has no user message")
    users[-1]["content"] = fill(str(users[-1]["content"]))
    return messages


def render_prompt(tokenizer: Any, prompt: str | list[dict], fmt: PromptFormat) -> str:
    """The text the engine continues: chat-formatted when asked, then the response prefix."""
    if fmt.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = prompt
    return text + fmt.response_prefix


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` taken verbatim: a chat template writes its own special tokens, and raw
    prompts carry a BOS in the text if the model needs one."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def round_trip_problems(tokenizer: Any, items: Iterable[tuple[str, str, str]], limit: int = 3) -> list[str]:
    """Texts that come back changed from encode -> decode, as warnings naming where each came from.

    items: (where, what, text), e.g. ("train.jsonl:4", "prompt", "add 1 2 ="). A tokenizer that
    drops spaces or unknown characters turns "1 2 3" into "123", and then no reward can be earned.
    """
    changed = []
    for where, what, text in items:
        back = tokenizer.decode(encode_text(tokenizer, text), skip_special_tokens=False)
        if back != text:
            changed.append((where, what, text, back))
    if not changed:
        return []
    shown = [f"  {where} {what}: {text!r} comes back as {back!r}" for where, what, text, back in changed[:limit]]
    more = f"\n  ... and {len(changed) - limit} more" if len(changed) > limit else ""
    return [f"{len(changed)} checked text(s) do not survive the tokenizer (encode then decode); the model "
            f"cannot see or write them as they are:\n" + "\n".join(shown) + more]
