"""SFT data: rows of prompt + response (a string or segments), or chat conversations (messages), as
token ids with loss masks; and the deterministic batches over them.

A conversation row (``sft.messages_key``, TRL's conversational format: a list of {"role", "content"})
is rendered with the tokenizer's chat template and trained on its assistant turns only: the
system and user turns, and the template's own headers, are input. Each assistant turn's tokens are the
difference between the conversation rendered up to it (with the generation prompt) and up to its end,
so they are exactly the tokens the template gives; a template whose renderings are not prefixes of one
another (some drop earlier reasoning) is refused with the row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tether.trainer.batch import TrainBatch
from tether.config import TetherConfig
from tether.rollout.data_source import read_rows
from tether.rollout.hf_rows import is_hub
from tether.rollout.prompt_format import (DatasetError, PromptFormat, encode_text, fill_template, get_prompt,
                                          render_prompt)


def load_sft_rows(cfg: TetherConfig, tokenizer, texts: list | None = None) -> list[tuple]:
    """One entry per row; errors name the file, the line and the field.

    A row's response is a string (all of it trained on), or a list of segments
    ``[{"text": "<calc>3*4</calc>"}, {"text": "<result>12</result>", "train": false}, {"text": "12"}]``:
    each segment is encoded on its own (as a multi-turn rollout produces them), and segments with
    ``"train": false`` (a tool's output, another speaker's turn) are input only, never a target. The
    eos at the end is always a target. An entry is ``(prompt ids, response ids + eos)``, or
    ``(prompt ids, response ids + eos, loss mask)`` when some segment is not trained on.

    Prompts are formatted like RL prompts (data.prompt_template, chat template, response prefix).
    A row with ``sft.messages_key`` is a conversation instead (module docstring): its assistant turns
    are the targets. ``texts``, when given, receives (where, "prompt" | "response", text) of every row (a
    segmented response as its segments joined).
    """
    s, d = cfg.sft, cfg.data
    fmt = PromptFormat.from_config(d)
    if s.path is None:
        raise DatasetError("sft.path is required for `tether sft` (a JSONL or Parquet file with prompt and response)")
    if not is_hub(s.path) and not Path(s.path).exists():
        raise DatasetError(f"sft.path: file not found: {s.path}")
    rows = []
    for _, where, obj in read_rows(s.path, split=s.split, subset=d.subset):
        if s.messages_key in obj:
            prompt_ids, response_ids, mask = conversation_ids(tokenizer, obj[s.messages_key], where, s.messages_key)
            rows.append((prompt_ids, response_ids) if all(mask) else (prompt_ids, response_ids, mask))
            if texts is not None:
                texts += [(where, "prompt", tokenizer.decode(prompt_ids))]
            continue
        prompt = fill_template(fmt, get_prompt(obj, where, s.prompt_key, d.apply_chat_template), obj, where,
                               s.prompt_key)
        segments = response_segments(obj.get(s.response_key), where, s.response_key)
        text = render_prompt(tokenizer, prompt, fmt)
        if texts is not None:
            texts += [(where, "prompt", text), (where, "response", "".join(t for t, _ in segments))]
        prompt_ids, response_ids, mask = encode_text(tokenizer, text), [], []
        for segment, train in segments:
            ids = encode_text(tokenizer, segment)
            response_ids += ids
            mask += [int(train)] * len(ids)
        # The eos is a target too: the model must learn where to stop.
        response_ids.append(tokenizer.eos_token_id)
        mask.append(1)
        rows.append((prompt_ids, response_ids) if all(mask) else (prompt_ids, response_ids, mask))
    if not rows:
        raise DatasetError(f"{s.path}: no rows")
    return rows


SEGMENT_KEYS = ("text", "train")


def response_segments(response, where: str, key: str) -> list[tuple[str, bool]]:
    """(text, trained on) of each part of an SFT row's response: a string, or a list of segments
    ``{"text": str, "train": bool}`` (``train`` defaults to true; null counts as not given, as Parquet
    fills in a key that only other segments have). Errors name the row and the segment's field."""
    if isinstance(response, str):
        return [(response, True)]
    if not isinstance(response, list):
        raise DatasetError(f"{where}: field '{key}' must be a string or a list of segments "
                           f'({{"text": ..., "train": false}}), got {type(response).__name__}')
    if not response:
        raise DatasetError(f"{where}: field '{key}' is an empty list of segments")
    out = []
    for i, seg in enumerate(response):
        name = f"{key}[{i}]"
        if not isinstance(seg, dict):
            raise DatasetError(f"{where}: field '{name}' must be an object "
                               f'{{"text": str, "train": bool}}, got {type(seg).__name__}')
        unknown = sorted(set(seg) - set(SEGMENT_KEYS))
        if unknown:
            raise DatasetError(f"{where}: field '{name}' has unknown key(s) {', '.join(map(repr, unknown))} "
                               f"(a segment has {' and '.join(map(repr, SEGMENT_KEYS))})")
        if not isinstance(seg.get("text"), str):
            got = "nothing" if seg.get("text") is None else type(seg["text"]).__name__
            raise DatasetError(f"{where}: field '{name}.text' must be a string, got {got}")
        train = seg.get("train")
        if train is not None and not isinstance(train, bool):
            raise DatasetError(f"{where}: field '{name}.train' must be true or false, got {train!r}")
        out.append((seg["text"], train is not False))
    return out


def batches(rows: list, batch_size: int, epochs: int, seed: int):
    """Deterministic per-epoch shuffles; the last partial batch of an epoch is dropped. A batch has
    loss masks when one of its rows has one (the others' are all 1); otherwise none, as before."""
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(len(rows))
        for start in range(0, len(rows) - batch_size + 1, batch_size):
            chosen = [rows[i] for i in order[start : start + batch_size]]
            masks = None
            if any(len(row) > 2 for row in chosen):
                masks = [list(row[2]) if len(row) > 2 else [1] * len(row[1]) for row in chosen]
            yield TrainBatch(tokens=[row[0] + row[1] for row in chosen], prompt_lengths=[len(row[0]) for row in chosen],
                             response_lengths=[len(row[1]) for row in chosen], loss_masks=masks)


ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages, where: str, key: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: field '{key}' must be a non-empty list of {{\"role\", \"content\"}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: field '{key}[{i}]' must be {{\"role\": one of {', '.join(ROLES)}, "
                               f"\"content\": str}}, got {m!r:.120}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(f"{where}: field '{key}' has no assistant message: nothing to train on")
    if messages[0]["role"] == "assistant":
        raise DatasetError(f"{where}: field '{key}[0]' is an assistant message: a conversation starts with a "
                           "system or user message")


def conversation_ids(tokenizer, messages, where: str, key: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, loss mask) of a chat conversation: the prompt is everything before the
    first assistant turn; in the response, assistant turns are trained (1) and the turns between them
    are input (0). Messages after the last assistant turn are dropped (nothing to learn from them)."""
    _check_messages(messages, where, key)
    if getattr(tokenizer, "chat_template", None) is None:
        raise DatasetError(f"{where}: field '{key}' is a conversation, and the model's tokenizer has no chat "
                           "template to render it (use prompt/response rows, or a model with one)")

    def render(upto: int, generation_prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(messages[:upto], tokenize=True, return_dict=False,
                                                  add_generation_prompt=generation_prompt))

    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after = render(i, True), render(i + 1, False)
        if before[: len(ids)] != ids or after[: len(before)] != before:
            raise DatasetError(f"{where}: field '{key}[{i}]': the chat template renders the conversation up to "
                               "this turn as something other than a continuation of the turns before it, so its "
                               "tokens cannot be told apart")
        mask += [0] * (len(before) - len(ids)) + [1] * (len(after) - len(before))
        ids = after
    first = mask.index(1)
    return ids[:first], ids[first:], mask[first:]
