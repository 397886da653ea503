"""The synchronous RL loop, one step after another as below. It takes its parts as handles; its pieces
(begin, save, push_eval_log) also make up the one-step-off loop in loop_async.py.

    generate(k) -> [offload engines] -> train(k) -> [save] -> [offload trainer, onload weights]
    -> push weights -> [onload kv cache] -> [eval]

Engines always serve the trainer's weights: they receive them before the first rollout, so a run
resumed from a checkpoint generates with the checkpoint's policy, not the model directory's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from tether.engine.base import KV_CACHE, WEIGHTS
from tether.errors import CheckpointSaveError, EnginesLostInPush
from tether.run.faults import crash_point


class Trainer(Protocol):
    def train(self, step_id: int, batch_ref: Any) -> dict[str, float]: ...
    def push_weights(self, version: int) -> dict[str, float]: ...
    def save(self, staging_dir: str) -> None: ...
    def offload(self) -> None: ...
    def onload(self) -> None: ...


class Rollout(Protocol):
    def generate(self, rollout_id: int) -> tuple[Any, dict[str, float]]: ...
    def eval(self, rollout_id: int) -> dict[str, float]: ...
    def prepare_data(self) -> dict:
        """Before the first rollout of a run (data.difficulty's probe); its metrics."""
        ...
    def save_state(self, ckpt_dir: str) -> None: ...
    def offload(self, tags: list[str]) -> None: ...
    def onload(self, tags: list[str]) -> None: ...
    def replace_engines(self, indices: list[int], reason: str) -> float:
        """Replace these lost engines (each gets the trainer's current weights); the seconds it took."""
        ...


class SavesState(Protocol):
    """What ``save`` needs of the rollout side: a Rollout, or SFT's data position."""
    def save_state(self, ckpt_dir: str) -> None: ...


class Checkpointer(Protocol):
    def stage(self, rollout_id: int) -> str: ...
    def commit(self, rollout_id: int, metrics: dict[str, float] | None = None) -> str: ...
    def abandon(self, rollout_id: int) -> str | None: ...


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float], *, total: int | None = None) -> None: ...


class Startup(Protocol):
    """Start-up phases timed as they finish (tether/tracking/startup.py)."""
    def lap(self, name: str, detail: str = "") -> float: ...
    def metrics(self) -> dict[str, float]: ...
    def report(self) -> None: ...


@dataclass
class LoopPlan:
    start: int
    """First rollout id to run (0, or the saved id + 1 when resuming)."""
    num_rollout: int
    num_rollout_per_epoch: int
    eval_interval: int | None
    save_interval: int | None
    offload: bool
    has_eval: bool
    redo_eval: bool = False
    """Resuming after a crash that lost the eval of the checkpointed rollout: run it first."""

    def eval_due(self, rollout_id: int) -> bool:
        """After rollout k when k+1 is a multiple of the interval, and after the last rollout."""
        if not self.has_eval or self.eval_interval is None:
            return False
        return (rollout_id + 1) % self.eval_interval == 0 or rollout_id + 1 == self.num_rollout

    def save_due(self, rollout_id: int) -> bool:
        at_interval = self.save_interval is not None and (rollout_id + 1) % self.save_interval == 0
        epoch_end = (rollout_id + 1) % self.num_rollout_per_epoch == 0
        return at_interval or epoch_end or rollout_id + 1 == self.num_rollout


def merge(metrics: dict, new: dict) -> dict:
    """``metrics.update(new)``, except that the "warnings" lists of both are kept (tracker.WARNINGS)."""
    warnings = metrics.get("warnings", []) + new.get("warnings", [])
    metrics.update(new)
    if warnings:
        metrics["warnings"] = warnings
    return metrics


def sync_weights(trainer: Trainer, rollout: Rollout, version: int, offload: bool) -> dict[str, float]:
    """Engines get the trainer's weights; with offload the trainer steps aside first."""
    if offload:
        trainer.offload()
        rollout.onload([WEIGHTS])
    metrics = push_weights(trainer, rollout, version)
    if offload:
        rollout.onload([KV_CACHE])
    return metrics


def push_weights(trainer: Trainer, rollout: Rollout, version: int) -> dict[str, float]:
    """The trainer's push. Engines that die during it are replaced (with the current weights, up to
    cluster.max_engine_restarts) and the push is made again, as a lost engine is during a rollout."""
    try:
        return trainer.push_weights(version)
    except EnginesLostInPush as err:
        lost = err
    seconds = rollout.replace_engines(lost.indices, lost.reason)
    metrics = trainer.push_weights(version)
    return {**metrics, "faults/engines_replaced_in_push": float(len(lost.indices)),
            "timing/engine_replace_s": seconds}


def begin(plan: LoopPlan, trainer: Trainer, rollout: Rollout, tracker: Tracker, startup: Startup | None) -> None:
    """Before the first rollout: push the weights, eval the starting policy (or redo a lost eval when
    resuming), and complete and print the start-up clock."""
    first = sync_weights(trainer, rollout, plan.start, plan.offload)
    if startup is not None:
        startup.lap("first weight push")
    if plan.start == 0:
        # What the data's difficulty needs measured with the starting policy (a resumed run has it in
        # its checkpoint's data state).
        merge(first, rollout.prepare_data())
        if plan.has_eval and plan.eval_interval is not None:
            # The baseline: how the starting policy scores (step 0, before any update). A resumed
            # run does not repeat it: its baseline is already in the metrics file.
            merge(first, rollout.eval(0))
            if startup is not None:
                startup.lap("eval at step 0")
        first["timing/weight_sync_s"] = first.pop("weight_sync/seconds", 0.0)
        if startup is not None:
            first.update(startup.metrics())
            startup.report()
        tracker.log(0, first, total=plan.num_rollout)
    else:
        if plan.redo_eval and plan.eval_due(plan.start - 1):
            tracker.log(plan.start, rollout.eval(plan.start), total=plan.num_rollout)
        if startup is not None:
            startup.report()


def save(trainer: Trainer, rollout: SavesState, checkpointer: Checkpointer, rollout_id: int, metrics: dict) -> None:
    """Checkpoint after rollout_id's train step: trainer and rollout state, then the commit. A save
    that fails (disk full, permission) is removed, so the previous checkpoint stays the latest."""
    t_save = time.perf_counter()
    try:
        staging = checkpointer.stage(rollout_id)
        trainer.save(staging)
        crash_point("save", rollout_id)  # the staging directory is half written here
        rollout.save_state(staging)
        metrics["timing/save_s"] = time.perf_counter() - t_save
        # The rollout's metrics so far ride in the checkpoint: a crash before the log line below
        # must not lose the row of a rollout that a resume will not redo.
        checkpointer.commit(rollout_id, {"step": rollout_id + 1, **{k: v for k, v in metrics.items() if k != "warnings"}})
    except (OSError, RuntimeError) as err:  # RuntimeError: a trainer's CheckpointSaveError, through Ray
        kept = checkpointer.abandon(rollout_id)
        cause = getattr(err, "cause", None) or err
        raise CheckpointSaveError(f"the checkpoint of rollout {rollout_id} was not saved ({cause}); "
                                  f"{kept or 'no earlier checkpoint'} is still the latest") from None
    crash_point("committed", rollout_id)


def perf_metrics(iteration_s: float, train_s: float | None, generate_s: float | None,
                 samples: float | None) -> dict[str, float]:
    """Throughput and idle shares of one iteration: samples trained per second, and the share of the
    iteration the trainer was not training and the engines were not generating rollouts."""
    out = {}
    if samples is not None:
        out["perf/samples_per_s"] = samples / iteration_s
    if train_s is not None:
        out["perf/train_idle_frac"] = max(0.0, 1.0 - train_s / iteration_s)
    if generate_s is not None:
        out["perf/rollout_idle_frac"] = max(0.0, 1.0 - generate_s / iteration_s)
    return out


def push_eval_log(plan: LoopPlan, trainer: Trainer, rollout: Rollout, tracker: Tracker, progress: Any,
                  rollout_id: int, metrics: dict, t0: float, generate_s: float | None) -> None:
    """The end of rollout_id's iteration: push the new weights, eval when due, log the row.
    ``generate_s``: the engines' rollout generation during this iteration (for perf/*)."""
    sync = sync_weights(trainer, rollout, rollout_id + 1, plan.offload)
    metrics["timing/weight_sync_s"] = sync.pop("weight_sync/seconds", 0.0)
    metrics.update(sync)
    if plan.eval_due(rollout_id):
        merge(metrics, rollout.eval(rollout_id + 1))
    metrics["timing/rollout_s"] = time.perf_counter() - t0
    metrics.update(perf_metrics(metrics["timing/rollout_s"], metrics.get("timing/train_s"), generate_s,
                                metrics.get("rollout/samples")))
    # Step k+1 = the policy after k+1 updates, so eval at step 0 is the starting policy.
    tracker.log(rollout_id + 1, metrics, total=plan.num_rollout)
    if progress is not None:
        progress.update(1)


def run_loop(plan: LoopPlan, trainer: Trainer, rollout: Rollout, checkpointer: Checkpointer, tracker: Tracker,
             progress: Any = None, startup: Startup | None = None) -> None:
    """Rollouts plan.start .. plan.num_rollout - 1. Weights are pushed once before the first one.
    ``startup``: the run's start-up clock, completed with the first push and eval, then printed."""
    begin(plan, trainer, rollout, tracker, startup)
    for rollout_id in range(plan.start, plan.num_rollout):
        t0 = time.perf_counter()
        batch_ref, metrics = rollout.generate(rollout_id)
        if plan.offload:
            rollout.offload([WEIGHTS, KV_CACHE])
            trainer.onload()
        merge(metrics, trainer.train(rollout_id, batch_ref))
        if plan.save_due(rollout_id):
            save(trainer, rollout, checkpointer, rollout_id, metrics)
        push_eval_log(plan, trainer, rollout, tracker, progress, rollout_id, metrics, t0, metrics.get("timing/generate_s"))
