"""`tether train`: place the actors, resume if asked, run the loop, export, summarise."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tether.run.checkpoint import Checkpointer, find_latest, read_meta
from tether.cluster import RemoteTimeout, plan_placement
from tether.engine.backends import placed_engines, served_engines
from tether.config import TetherConfig, public_dict
from tether.errors import EngineDiedError, TrainerDiedError
from tether.loop import LoopPlan, run_loop
from tether.loop_async import run_fully_async, run_one_step_off
from tether.run.resume import check_resume_config, trim_jsonl
from tether.run.output_dir import claim
from tether.trainer.actor import TRAINED_SAMPLES
from tether.rollout.handle import RolloutHandle, create_engines
from tether.rollout.replay import ReplayRollout, WithoutEngines
from tether.tracking import Tracker
from tether.tracking.startup import StartupClock
from tether.trainer.group import TrainerGroup


def resolve_resume(cfg: TetherConfig, overwrite: bool = False, config_path: str | None = None,
                   command: str = "train") -> tuple[str | None, int, dict]:
    """(checkpoint path, first rollout id, its meta). A --load directory without one starts fresh.

    A fresh start claims the output directory (tether/run/output_dir.py): it refuses to write over an
    earlier run unless ``overwrite``. meta["redo_eval"] is set when the crash came after the
    checkpoint but before that rollout's eval was logged.

    The config is checked against the checkpoint's before anything starts, and the run's logs are
    trimmed to the checkpoint: rollouts after it are redone, so their old rows would be duplicates.
    """
    found = find_latest(cfg.checkpoint.load) if cfg.checkpoint.load else None
    if found is None:
        if cfg.checkpoint.load:
            print(f"[tether] no complete checkpoint in {cfg.checkpoint.load}: starting from rollout 0", file=sys.stderr)
        # Asked to resume a run that never finished a checkpoint: its logs describe nothing that
        # survives, so they are replaced; any other earlier run is refused unless overwriting.
        nothing_kept = bool(cfg.checkpoint.load) and find_latest(cfg.checkpoint_dir) is None
        for deleted in claim(cfg.output_dir, cfg.checkpoint_dir, overwrite=overwrite or nothing_kept, command=command,
                             config_path=config_path):
            print(f"[tether] deleted {deleted} of the earlier run", file=sys.stderr)
        return None, 0, {}
    path, rollout_id = found
    meta = read_meta(path)
    check_resume_config(meta["config"], public_dict(cfg), str(path))
    out = Path(cfg.output_dir)
    metrics_path = out / "metrics.jsonl"
    trim_jsonl(metrics_path, lambda row: row.get("step", 0) <= rollout_id + 1)
    trim_jsonl(out / TRAINED_SAMPLES, lambda row: row["rollout_id"] <= rollout_id)
    meta["redo_eval"] = restore_metrics_row(metrics_path, meta.get("metrics_row"))
    print(f"[tether] resuming from {path} (rollout {rollout_id} done, continuing at {rollout_id + 1})", file=sys.stderr)
    return str(path), rollout_id + 1, meta


def restore_metrics_row(path: Path, row: dict | None) -> bool:
    """Put back the checkpointed rollout's row when the crash came before it was logged."""
    if not row:
        return False
    lines = path.read_text().splitlines() if path.is_file() else []
    if row["step"] in {json.loads(line).get("step") for line in lines if line.strip()}:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), **row}) + "\n")
    return True


def make_tracker(cfg: TetherConfig, step_label: str = "rollout", run_id: str | None = None) -> Tracker:
    t = cfg.tracking
    return Tracker(cfg.output_dir, run_name=t.run_name or Path(cfg.output_dir).name, config=public_dict(cfg),
                   jsonl=t.jsonl, tensorboard=t.tensorboard, wandb=t.wandb, wandb_project=t.wandb_project,
                   wandb_mode=t.wandb_mode, console=t.console, step_label=step_label, resume_run_id=run_id)


LOOPS = {"sync": run_loop, "one_step_off": run_one_step_off, "fully_async": run_fully_async}
"""rollout.schedule.mode -> the loop that runs it (tether/loop.py, tether/loop_async.py)."""


def pick_loop(cfg: TetherConfig):
    return LOOPS[cfg.rollout.schedule.mode]


RESUMABLE = (TrainerDiedError, EngineDiedError, RemoteTimeout)
"""Failures of a process or a call that a restart from the last checkpoint can get past (not a NaN
loss, a bad input or a full disk: those would happen again)."""


def train(cfg: TetherConfig, overwrite: bool = False, config_path: str | None = None) -> dict:
    """Run RL training as configured; returns the run summary. ``overwrite``: a fresh start may
    delete an earlier run's logs and checkpoints in its directories (else it refuses to start).
    With checkpoint.auto_resume: N, a run that loses a process restarts from its latest complete
    checkpoint (as `--load` would) up to N times; the error that stops it names that checkpoint."""
    restarts = 0
    while True:
        try:
            return _train_once(cfg, overwrite, config_path)
        except RESUMABLE as err:
            latest = find_latest(cfg.checkpoint_dir)
            where = (f"the latest complete checkpoint is {latest[0]}" if latest
                     else "no checkpoint was completed yet")
            if restarts == cfg.checkpoint.auto_resume:
                hint = (f" (resume with --load {cfg.checkpoint_dir}, or set checkpoint.auto_resume)"
                        if latest and not cfg.checkpoint.auto_resume else "")
                raise type(err)(f"{err}\n{where}{hint}") from None
            restarts += 1
            print(f"[tether] {err}\n[tether] auto-resume {restarts}/{cfg.checkpoint.auto_resume}: "
                  f"restarting from {latest[0] if latest else 'rollout 0'}", file=sys.stderr)
            cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(
                update={"load": str(cfg.checkpoint_dir)})})
            overwrite = False


def _train_once(cfg: TetherConfig, overwrite: bool, config_path: str | None) -> dict:
    clock = StartupClock()
    load_path, start, meta = resolve_resume(cfg, overwrite, config_path)
    placement = plan_placement(cfg.cluster, placed_engines(cfg), served_engines(cfg))
    clock.lap("ray")
    # Trainer, engines and rollout manager start together (each imports torch and loads its part).
    trainer = TrainerGroup(cfg, placement)
    replay = cfg.debug.load_rollouts is not None  # saved rollouts stand in for the engines
    engines = [] if replay else create_engines(cfg, placement)
    rollout = ReplayRollout(cfg) if replay else RolloutHandle(cfg, engines, placement)
    try:
        trainer.start()
        ready = {**getattr(rollout, "ready_s", {}), "trainer": clock.since_last()}
        clock.lap("actors", ", ".join(f"{name} {s:.1f}s" for name, s in ready.items()))
        per_epoch = rollout.num_rollout_per_epoch()
        num_rollout = cfg.rollout.num_rollout or per_epoch * cfg.rollout.num_epoch
        samples = cfg.rollout.prompts_per_rollout * cfg.rollout.n_samples_per_prompt
        trainer.init(num_rollout * (samples // cfg.global_batch_size), cfg.algorithm.needs_ref_model, load_path)
        clock.lap("trainer init")
        if load_path:
            rollout.load_state(load_path)
        if engines or cfg.external_engines:
            trainer.connect_engines(engines, cfg.external_engines)
            if isinstance(rollout, RolloutHandle):  # a replay has no engines of its own to replace
                rollout.load_weights = trainer.replace_engine  # a replaced engine gets the current weights
        plan = LoopPlan(start=start, num_rollout=num_rollout, num_rollout_per_epoch=per_epoch,
                        eval_interval=cfg.eval.interval, save_interval=cfg.checkpoint.save_interval,
                        offload=cfg.cluster.offload and not replay, has_eval=bool(cfg.eval.datasets) and not replay,
                        redo_eval=meta.get("redo_eval", False))
        # Same run id on resume: TensorBoard and W&B continue the run instead of starting another.
        tracker = make_tracker(cfg, run_id=meta.get("tracker_run_id"))
        checkpointer = Checkpointer(cfg.checkpoint_dir, public_dict(cfg), cfg.checkpoint.keep_last,
                                    extra=lambda: {"tracker_run_id": tracker.run_id,
                                                   "train_world_size": cfg.cluster.num_train_actors},
                                    hf_source=cfg.model.path)
        print(f"[tether] {rollout.info['train_rows']} prompts, {per_epoch} rollouts per epoch, "
              f"rollouts {start}..{num_rollout - 1}", file=sys.stderr)
        with tracker:
            for warning in rollout.info["warnings"]:
                tracker.warn(warning)
            skipped = rollout.info.get("skipped_bad_rows", [])  # none when replaying saved rollouts
            if skipped:
                tracker.warn(f"data.skip_bad_rows: skipped {len(skipped)} bad row(s): " + "; ".join(skipped[:3])
                             + (" ..." if len(skipped) > 3 else ""))
            bar = tracker.progress(num_rollout, "rollouts", initial=start)
            loop = pick_loop(cfg)
            loop(plan, WithoutEngines(trainer) if replay else trainer, rollout, checkpointer, tracker, progress=bar,
                 startup=clock)
            if cfg.checkpoint.export_hf:
                trainer.save_hf(str(Path(cfg.output_dir) / "hf"))
        return tracker.finish()
    finally:
        rollout.shutdown()
        trainer.shutdown()
        placement.remove()


def generate_rollouts(cfg: TetherConfig, overwrite: bool = False, config_path: str | None = None) -> dict:
    """`tether rollout`: rollouts 0..num_rollout-1 of model.path, generated, scored and saved as
    rollout_<id>.jsonl (debug.save_rollouts, default <output_dir>/rollouts), without training: every
    rollout samples the same policy, drawing prompts as a training run would."""
    for path in claim(cfg.output_dir, cfg.checkpoint_dir, overwrite=overwrite, command="rollout",
                      config_path=config_path):
        print(f"[tether] deleted {path} of the earlier run", file=sys.stderr)
    placement = plan_placement(cfg.cluster, placed_engines(cfg), served_engines(cfg))
    engines = create_engines(cfg, placement)
    rollout = RolloutHandle(cfg, engines, placement)  # a replaced engine loads model.path, as the others did
    try:
        rollout.keep_all_dumps()
        num_rollout = cfg.rollout.num_rollout or rollout.num_rollout_per_epoch() * cfg.rollout.num_epoch
        with make_tracker(cfg) as tracker:
            bar = tracker.progress(num_rollout, "rollouts")
            for rollout_id in range(num_rollout):
                _, metrics = rollout.generate(rollout_id)
                tracker.log(rollout_id + 1, metrics, total=num_rollout)
                bar.update(1)
        print(f"[tether] {num_rollout} rollout(s) saved in {cfg.debug.save_rollouts or Path(cfg.output_dir) / 'rollouts'}; "
              f"train on them with debug.load_rollouts=<that directory>", file=sys.stderr)
        return tracker.finish()
    finally:
        rollout.shutdown()
        placement.remove()
