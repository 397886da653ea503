"""`tether sft`: supervised fine-tuning through the same trainer, loss on response tokens only.

Checkpoints (checkpoint.save_interval, in SFT steps, and at the end of every epoch) hold the trainer's
model, optimizer, schedule and RNG; the batches are a function of (seed, epoch), so `tether sft --load
DIR` continues at the step after the checkpoint with exactly the batches the run would have had.
"""

from __future__ import annotations

import json
from pathlib import Path

import ray

from tether.cluster import plan_placement
from tether.config import TetherConfig
from tether.run.evaluate import run_evals, scores_table
from tether.rollout.prompt_format import ROUND_TRIP_ROWS, round_trip_problems
from tether.sft.data import batches, load_sft_rows, response_segments  # noqa: F401 (the SFT data, re-exported)
from tether.run.checkpoint import Checkpointer
from tether.config import public_dict
from tether.loop import save
from tether.rollout.manager import DATA_STATE
from tether.train import make_tracker, resolve_resume
from tether.trainer.group import TrainerGroup
from tether.models.hf import load_tokenizer


class SftPosition:
    """Where the SFT data stands, written into a checkpoint as its data-source state (data_source.json):
    the batches are a function of (seed, epoch), so the next step is the whole position."""

    def __init__(self, seed: int, steps_per_epoch: int):
        self.seed, self.steps_per_epoch, self.next_step = seed, steps_per_epoch, 0

    def save_state(self, staging: str) -> None:
        state = {"kind": "sft", "seed": self.seed, "next_step": self.next_step,
                 "epoch": self.next_step // self.steps_per_epoch}
        (Path(staging) / DATA_STATE).write_text(json.dumps(state) + "\n")


def sft(cfg: TetherConfig, overwrite: bool = False, config_path: str | None = None) -> dict:
    """Supervised fine-tuning as configured; exports <output_dir>/hf and returns the run summary.
    With checkpoint.load (`--load DIR`), continues from the latest complete checkpoint there."""
    load_path, start, meta = resolve_resume(cfg, overwrite, config_path, command="sft")
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
    tracker = make_tracker(cfg, step_label="sft step", run_id=meta.get("tracker_run_id"))
    checkpointer = Checkpointer(cfg.checkpoint_dir, public_dict(cfg), cfg.checkpoint.keep_last,
                                extra=lambda: {"tracker_run_id": tracker.run_id,
                                               "train_world_size": cfg.cluster.num_train_actors},
                                hf_source=cfg.model.path)
    with tracker:
        for text in text_warnings:
            tracker.warn(text)
        train_and_export(cfg, rows, total, tracker, hf_dir, checkpointer, load_path, start)
        if cfg.eval.datasets:
            # The SFT model on the eval sets: the "before" of the RL run that starts from it.
            metrics = run_evals(cfg, str(hf_dir), Path(cfg.output_dir) / "eval", step=total)
            tracker.console = cfg.tracking.console
            tracker.log(total, metrics, total=total)
            print(scores_table(metrics))
    return tracker.finish()


def train_and_export(cfg: TetherConfig, rows: list, total: int, tracker, hf_dir: Path,
                     checkpointer: Checkpointer | None = None, load_path: str | None = None, start: int = 0) -> None:
    """SFT steps ``start``..total-1 on the trainer actors (from ``load_path``'s state when resuming), then
    the model as an HF directory; the actors are gone after."""
    bs = cfg.sft.batch_size
    steps_per_epoch = total // cfg.sft.num_epoch
    placement = plan_placement(cfg.cluster)
    trainer = TrainerGroup(cfg, placement)
    try:
        trainer.init(total, with_ref=False, load_dir=load_path)
        position = SftPosition(cfg.seed, steps_per_epoch)
        bar = tracker.progress(total, "sft steps")
        bar.update(start)
        for step, batch in enumerate(batches(rows, bs, cfg.sft.num_epoch, cfg.seed)):
            if step < start:  # done before the checkpoint: the same batches, not trained again
                continue
            metrics = trainer.train(step, ray.put(batch), policy_loss="sft", global_batch_size=bs)
            metrics["sft/epoch"] = float(step // steps_per_epoch)
            interval = cfg.checkpoint.save_interval
            if checkpointer is not None and ((interval and (step + 1) % interval == 0)
                                             or (step + 1) % steps_per_epoch == 0):
                position.next_step = step + 1
                save(trainer, position, checkpointer, step, metrics)
            # One line every ~5% of the run keeps the console readable; every step goes to the files.
            tracker.console = cfg.tracking.console and ((step + 1) % max(1, total // 20) == 0 or step + 1 == total)
            tracker.log(step + 1, metrics, total=total)
            bar.update(1)
        bar.close()
        trainer.save_hf(str(hf_dir))
    finally:
        trainer.shutdown()
        placement.remove()
