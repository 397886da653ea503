"""`tether train`: place the actors, resume if asked, run the loop, export, summarise."""

from __future__ import annotations

import sys
from pathlib import Path

from tether.checkpoint import Checkpointer, find_latest
from tether.cluster import plan_placement
from tether.config import TetherConfig
from tether.loop import LoopPlan, run_loop
from tether.rollout.handle import RolloutHandle, create_engines
from tether.tracking import Tracker
from tether.trainer.group import TrainerGroup


def resolve_resume(cfg: TetherConfig) -> tuple[str | None, int]:
    """(checkpoint path, first rollout id). A --load directory without a checkpoint starts fresh."""
    if not cfg.checkpoint.load:
        return None, 0
    found = find_latest(cfg.checkpoint.load)
    if found is None:
        print(f"[tether] no complete checkpoint in {cfg.checkpoint.load}: starting from rollout 0", file=sys.stderr)
        return None, 0
    path, rollout_id = found
    print(f"[tether] resuming from {path} (rollout {rollout_id} done, continuing at {rollout_id + 1})", file=sys.stderr)
    return str(path), rollout_id + 1


def make_tracker(cfg: TetherConfig, step_label: str = "rollout") -> Tracker:
    t = cfg.tracking
    return Tracker(cfg.output_dir, run_name=t.run_name or Path(cfg.output_dir).name, config=cfg.model_dump(mode="json"),
                   jsonl=t.jsonl, tensorboard=t.tensorboard, wandb=t.wandb, wandb_project=t.wandb_project,
                   wandb_mode=t.wandb_mode, console=t.console, step_label=step_label)


def train(cfg: TetherConfig) -> dict:
    """Run RL training as configured; returns the run summary."""
    placement = plan_placement(cfg.cluster)
    trainer = TrainerGroup(cfg, placement)
    engines = create_engines(cfg, placement)
    rollout = RolloutHandle(cfg, engines)
    try:
        per_epoch = rollout.num_rollout_per_epoch()
        num_rollout = cfg.rollout.num_rollout or per_epoch * cfg.rollout.num_epoch
        samples = cfg.rollout.prompts_per_rollout * cfg.rollout.n_samples_per_prompt
        load_path, start = resolve_resume(cfg)
        trainer.init(num_rollout * (samples // cfg.global_batch_size), cfg.algorithm.needs_ref_model, load_path)
        if load_path:
            rollout.load_state(load_path)
        trainer.connect_engines(engines)
        plan = LoopPlan(start=start, num_rollout=num_rollout, num_rollout_per_epoch=per_epoch,
                        eval_interval=cfg.eval.interval, save_interval=cfg.checkpoint.save_interval,
                        offload=cfg.cluster.offload, has_eval=bool(cfg.eval.datasets))
        tracker = make_tracker(cfg)
        print(f"[tether] {rollout.info['train_rows']} prompts, {per_epoch} rollouts per epoch, "
              f"rollouts {start}..{num_rollout - 1}", file=sys.stderr)
        with tracker:
            bar = tracker.progress(num_rollout, "rollouts", initial=start)
            run_loop(plan, trainer, rollout, Checkpointer(cfg.checkpoint_dir, cfg.model_dump(mode="json")),
                     tracker, progress=bar)
            if cfg.checkpoint.export_hf:
                trainer.save_hf(str(Path(cfg.output_dir) / "hf"))
        return tracker.finish()
    finally:
        rollout.shutdown()
        trainer.shutdown()
        placement.remove()
