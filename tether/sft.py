"""`tether sft`: supervised fine-tuning through the same trainer, loss on response tokens only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import ray

from tether.batch import TrainBatch
from tether.cluster import plan_placement
from tether.config import TetherConfig
from tether.rollout.data_source import DatasetError, encode_prompt, get_prompt, read_jsonl
from tether.train import make_tracker
from tether.trainer.group import TrainerGroup
from tether.trainer.model import load_tokenizer


def load_sft_rows(cfg: TetherConfig, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + eos) per row; errors name the file, the line and the field."""
    s, d = cfg.sft, cfg.data
    if s.path is None:
        raise DatasetError("sft.path is required for `tether sft` (a JSONL file with prompt and response)")
    path = Path(s.path)
    if not path.is_file():
        raise DatasetError(f"sft.path: file not found: {path}")
    rows = []
    for line, obj in read_jsonl(path):
        where = f"{path}:{line}"
        prompt = get_prompt(obj, where, s.prompt_key, d.apply_chat_template)
        response = obj.get(s.response_key)
        if not isinstance(response, str):
            raise DatasetError(f"{where}: field '{s.response_key}' must be a string, got {type(response).__name__}")
        prompt_ids = encode_prompt(tokenizer, prompt, d.apply_chat_template)
        # The eos is a target too: the model must learn where to stop.
        response_ids = list(tokenizer.encode(response, add_special_tokens=False)) + [tokenizer.eos_token_id]
        rows.append((prompt_ids, response_ids))
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def batches(rows: list, batch_size: int, epochs: int, seed: int):
    """Deterministic per-epoch shuffles; the last partial batch of an epoch is dropped."""
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(len(rows))
        for start in range(0, len(rows) - batch_size + 1, batch_size):
            chosen = [rows[i] for i in order[start : start + batch_size]]
            yield TrainBatch(tokens=[p + r for p, r in chosen], prompt_lengths=[len(p) for p, _ in chosen],
                             response_lengths=[len(r) for _, r in chosen])


def sft(cfg: TetherConfig) -> dict:
    tokenizer = load_tokenizer(cfg.model.path)
    rows = load_sft_rows(cfg, tokenizer)
    bs = cfg.sft.batch_size
    if bs % cfg.cluster.num_train_actors:
        raise ValueError(f"sft.batch_size={bs} must be divisible by cluster.num_train_actors={cfg.cluster.num_train_actors}")
    steps_per_epoch = len(rows) // bs
    if steps_per_epoch == 0:
        raise ValueError(f"sft.batch_size={bs} is larger than the {len(rows)} rows of {cfg.sft.path}")
    total = steps_per_epoch * cfg.sft.num_epoch
    placement = plan_placement(cfg.cluster)
    trainer = TrainerGroup(cfg, placement)
    try:
        trainer.init(total, with_ref=False, load_dir=None)
        tracker = make_tracker(cfg, step_label="sft step")
        with tracker:
            bar = tracker.progress(total, "sft steps")
            for step, batch in enumerate(batches(rows, bs, cfg.sft.num_epoch, cfg.seed)):
                metrics = trainer.train(step, ray.put(batch), policy_loss="sft", global_batch_size=bs)
                metrics["sft/epoch"] = float(step // steps_per_epoch)
                # One line every ~5% of the run keeps the console readable; every step goes to the files.
                tracker.console = cfg.tracking.console and ((step + 1) % max(1, total // 20) == 0 or step + 1 == total)
                tracker.log(step + 1, metrics, total=total)
                bar.update(1)
            trainer.save_hf(str(Path(cfg.output_dir) / "hf"))
        return tracker.finish()
    finally:
        trainer.shutdown()
        placement.remove()
