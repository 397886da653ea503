"""`tether sft`: supervised fine-tuning through the same trainer, loss on response tokens only."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import ray

from tether.batch import TrainBatch
from tether.cluster import plan_placement
from tether.config import TetherConfig
from tether.evaluate import run_evals, scores_table
from tether.rollout.data_source import read_rows
from tether.rollout.prompt_format import (DatasetError, PromptFormat, encode_text, fill_template, get_prompt,
                                          ROUND_TRIP_ROWS, render_prompt, round_trip_problems)
from tether.run_dir import claim
from tether.train import make_tracker
from tether.trainer.group import TrainerGroup
from tether.hf import load_tokenizer


def load_sft_rows(cfg: TetherConfig, tokenizer, texts: list | None = None) -> list[tuple]:
    """One entry per row; errors name the file, the line and the field.

    A row's response is a string (all of it trained on), or a list of segments
    ``[{"text": "<calc>3*4</calc>"}, {"text": "<result>12</result>", "train": false}, {"text": "12"}]``:
    each segment is encoded on its own (as a multi-turn rollout produces them), and segments with
    ``"train": false`` (a tool's output, another speaker's turn) are input only, never a target. The
    eos at the end is always a target. An entry is ``(prompt ids, response ids + eos)``, or
    ``(prompt ids, response ids + eos, loss mask)`` when some segment is not trained on.

    Prompts are formatted like RL prompts (data.prompt_template, chat template, response prefix).
    ``texts``, when given, receives (where, "prompt" | "response", text) of every row (a segmented
    response as its segments joined).
    """
    s, d = cfg.sft, cfg.data
    fmt = PromptFormat.from_config(d)
    if s.path is None:
        raise DatasetError("sft.path is required for `tether sft` (a JSONL or Parquet file with prompt and response)")
    path = Path(s.path)
    if not path.is_file():
        raise DatasetError(f"sft.path: file not found: {path}")
    rows = []
    for _, where, obj in read_rows(path):
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
        raise DatasetError(f"{path}: no rows")
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


def sft(cfg: TetherConfig, overwrite: bool = False, config_path: str | None = None) -> dict:
    """Supervised fine-tuning as configured; exports <output_dir>/hf and returns the run summary."""
    for path in claim(cfg.output_dir, None, overwrite=overwrite, command="sft", config_path=config_path):
        print(f"[tether] deleted {path} of the earlier run", file=sys.stderr)
    tokenizer = load_tokenizer(cfg.model.path)
    texts: list = []
    rows = load_sft_rows(cfg, tokenizer, texts)
    text_warnings = round_trip_problems(tokenizer, texts[: 2 * ROUND_TRIP_ROWS])
    bs = cfg.sft.batch_size
    if bs % cfg.cluster.num_train_actors:
        raise ValueError(f"sft.batch_size={bs} must be divisible by cluster.num_train_actors={cfg.cluster.num_train_actors}")
    steps_per_epoch = len(rows) // bs
    if steps_per_epoch == 0:
        raise ValueError(f"sft.batch_size={bs} is larger than the {len(rows)} rows of {cfg.sft.path}")
    total = steps_per_epoch * cfg.sft.num_epoch
    hf_dir = Path(cfg.output_dir) / "hf"
    tracker = make_tracker(cfg, step_label="sft step")
    with tracker:
        for text in text_warnings:
            tracker.warn(text)
        train_and_export(cfg, rows, total, tracker, hf_dir)
        if cfg.eval.datasets:
            # The SFT model on the eval sets: the "before" of the RL run that starts from it.
            metrics = run_evals(cfg, str(hf_dir), Path(cfg.output_dir) / "eval", step=total)
            tracker.console = cfg.tracking.console
            tracker.log(total, metrics, total=total)
            print(scores_table(metrics))
    return tracker.finish()


def train_and_export(cfg: TetherConfig, rows: list, total: int, tracker, hf_dir: Path) -> None:
    """The SFT steps on the trainer actors, then the model as an HF directory; the actors are gone after."""
    bs = cfg.sft.batch_size
    steps_per_epoch = total // cfg.sft.num_epoch
    placement = plan_placement(cfg.cluster)
    trainer = TrainerGroup(cfg, placement)
    try:
        trainer.init(total, with_ref=False, load_dir=None)
        bar = tracker.progress(total, "sft steps")
        for step, batch in enumerate(batches(rows, bs, cfg.sft.num_epoch, cfg.seed)):
            metrics = trainer.train(step, ray.put(batch), policy_loss="sft", global_batch_size=bs)
            metrics["sft/epoch"] = float(step // steps_per_epoch)
            # One line every ~5% of the run keeps the console readable; every step goes to the files.
            tracker.console = cfg.tracking.console and ((step + 1) % max(1, total // 20) == 0 or step + 1 == total)
            tracker.log(step + 1, metrics, total=total)
            bar.update(1)
        bar.close()
        trainer.save_hf(str(hf_dir))
    finally:
        trainer.shutdown()
        placement.remove()
