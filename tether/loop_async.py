"""The asynchronous loops, beside the synchronous one in loop.py: one-step-off and fully async.

One-step-off (slime's train_async): rollout k+1 generates while the trainer trains on rollout k.

    generate(k)  ──────────────▶ train(k) ─┐            (k+1 overlaps train(k))
                  submit(k+1) ─ generate(k+1) ─┴─ wait both ─ push weights v(k+1) ─ submit(k+2) ...

Rollout k+1 is sampled under the weights of one step before (v(k), pushed after train(k-1)), so each
trained sample is at most one version stale; the engines report the version of every sample's tokens
and the existing rollout correction applies against their log-probs. Weights are pushed only once
the rollout in flight is done, never under running requests.

The pipeline drains before a checkpoint or an eval: after such a step the next rollout is generated
after the push, as the synchronous loop does. A run resumed from that checkpoint therefore starts
exactly where the uninterrupted run stood, and continues identically.

Fully async: groups stream through the engines without a barrier (tether/rollout/stream.py); each
iteration takes the next finished groups at most schedule.max_staleness versions old, trains on them, and
pushes the new weights while the stream is paused. Checkpoints and evals do not drain anything: the
stream's state (its data position and the groups drawn and not yet trained on) is saved with the
checkpoint, and evals generate beside the stream on the new weights.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from tether.loop import Checkpointer, LoopPlan, Rollout, Startup, Tracker, Trainer, begin, merge, push_eval_log, save


class PendingRollout(Protocol):
    def result(self) -> tuple[Any, dict[str, float]]: ...


class AsyncRollout(Rollout, Protocol):
    def submit_generate(self, rollout_id: int) -> PendingRollout:
        """Start generating rollout_id and return at once; ``result()`` waits for (batch_ref, metrics)."""
        ...


def overlaps(plan: LoopPlan, rollout_id: int) -> bool:
    """Whether rollout_id + 1 may generate during rollout_id's train step: not past the end, and not
    when a checkpoint or an eval follows the step (they need the engines on the new weights)."""
    return rollout_id + 1 < plan.num_rollout and not plan.save_due(rollout_id) and not plan.eval_due(rollout_id)


def run_one_step_off(plan: LoopPlan, trainer: Trainer, rollout: AsyncRollout, checkpointer: Checkpointer,
                     tracker: Tracker, progress: Any = None, startup: Startup | None = None) -> None:
    """Rollouts plan.start .. plan.num_rollout - 1, each generated during the previous one's train step
    where ``overlaps`` allows. Logs ``async/staleness`` (1 for an overlapped rollout, else 0) and
    ``timing/generate_wait_s`` (the trainer's wait for the rollout in flight after its step); perf/*
    counts an overlapped rollout's generation in the iteration it ran in."""
    begin(plan, trainer, rollout, tracker, startup)
    ready: tuple[Any, dict[str, float]] | None = None  # the next rollout, generated during the last step
    for rollout_id in range(plan.start, plan.num_rollout):
        t0 = time.perf_counter()
        stale = ready is not None
        batch_ref, metrics = ready if ready is not None else rollout.generate(rollout_id)
        metrics["async/staleness"] = float(stale)
        # Engine time in this iteration: this rollout's generation unless it ran during the last one.
        generated_s = 0.0 if stale else metrics.get("timing/generate_s", 0.0)
        pending = rollout.submit_generate(rollout_id + 1) if overlaps(plan, rollout_id) else None
        merge(metrics, trainer.train(rollout_id, batch_ref))
        if plan.save_due(rollout_id):
            save(trainer, rollout, checkpointer, rollout_id, metrics)
        ready = None
        if pending is not None:
            t_wait = time.perf_counter()
            ready = pending.result()
            metrics["timing/generate_wait_s"] = time.perf_counter() - t_wait
            generated_s += ready[1].get("timing/generate_s", 0.0)
        push_eval_log(plan, trainer, rollout, tracker, progress, rollout_id, metrics, t0, generated_s)


class StreamRollout(Rollout, Protocol):
    def start_stream(self, version: int, next_take: int) -> None:
        """Start generating groups under weight ``version``; the next take is rollout ``next_take``."""
        ...

    def take(self, rollout_id: int) -> tuple[Any, dict[str, float]]:
        """(batch_ref, metrics) of the next groups fresh enough for rollout_id (waits for them)."""
        ...

    def pause(self) -> None: ...
    def resume(self, version: int) -> None: ...


class PausedPush:
    """The trainer as push_eval_log uses it in the fully async loop: the stream pauses around each push."""

    def __init__(self, trainer: Trainer, rollout: StreamRollout):
        self.trainer, self.rollout = trainer, rollout

    def push_weights(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.rollout.pause()
        t1 = time.perf_counter()
        metrics = self.trainer.push_weights(version)
        t2 = time.perf_counter()
        self.rollout.resume(version)
        return {**metrics, "timing/stream_pause_s": t1 - t0, "timing/stream_resume_s": time.perf_counter() - t2}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)


def run_fully_async(plan: LoopPlan, trainer: Trainer, rollout: StreamRollout, checkpointer: Checkpointer,
                    tracker: Tracker, progress: Any = None, startup: Startup | None = None) -> None:
    """Rollouts plan.start .. plan.num_rollout - 1, each taken from the stream. perf/rollout_idle_frac
    counts the time the engines had no stream group to generate (async/engine_busy_s)."""
    begin(plan, trainer, rollout, tracker, startup)
    rollout.start_stream(plan.start, plan.start)
    pushing = PausedPush(trainer, rollout)
    for rollout_id in range(plan.start, plan.num_rollout):
        t0 = time.perf_counter()
        batch_ref, metrics = rollout.take(rollout_id)
        merge(metrics, trainer.train(rollout_id, batch_ref))
        if plan.save_due(rollout_id):
            save(trainer, rollout, checkpointer, rollout_id, metrics)
        push_eval_log(plan, pushing, rollout, tracker, progress, rollout_id, metrics, t0,
                      metrics.get("async/engine_busy_s"))
    rollout.pause()  # the groups still generating are not needed
