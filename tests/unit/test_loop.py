"""Unit tests for tether.loop: the order of calls in the synchronous RL loop, with in-process fakes."""

from __future__ import annotations

import pytest

from tether.loop import LoopPlan, run_loop, sync_weights

W, KV = "weights", "kv_cache"


class FakeTrainer:
    def __init__(self, calls: list):
        self.calls = calls

    def train(self, step_id, batch_ref):
        self.calls.append(("trainer.train", step_id, batch_ref))
        return {"train/loss": float(step_id)}

    def push_weights(self, version):
        self.calls.append(("trainer.push_weights", version))
        return {"weight_sync/seconds": 0.5, "weight_sync/bytes": 10.0}

    def save(self, staging_dir):
        self.calls.append(("trainer.save", staging_dir))

    def offload(self):
        self.calls.append(("trainer.offload",))

    def onload(self):
        self.calls.append(("trainer.onload",))


class FakeRollout:
    def __init__(self, calls: list):
        self.calls = calls

    def generate(self, rollout_id):
        self.calls.append(("rollout.generate", rollout_id))
        return f"batch{rollout_id}", {"rollout/reward": 1.0}

    def eval(self, rollout_id):
        self.calls.append(("rollout.eval", rollout_id))
        return {"eval/add/score": 0.25}

    def prepare_data(self):
        self.calls.append(("rollout.prepare_data",))
        return {"difficulty/probe_problems": 3.0}

    def save_state(self, ckpt_dir):
        self.calls.append(("rollout.save_state", ckpt_dir))

    def offload(self, tags):
        self.calls.append(("rollout.offload", list(tags)))

    def onload(self, tags):
        self.calls.append(("rollout.onload", list(tags)))


class FakeCheckpointer:
    def __init__(self, calls: list):
        self.calls = calls

    def stage(self, rollout_id):
        self.calls.append(("ckpt.stage", rollout_id))
        return f"stage{rollout_id}"

    def commit(self, rollout_id, metrics=None):
        self.calls.append(("ckpt.commit", rollout_id))
        return f"final{rollout_id}"


class FakeTracker:
    def __init__(self, calls: list):
        self.calls = calls
        self.logged: list[tuple[int, dict, int | None]] = []

    def log(self, step, metrics, *, total=None):
        self.calls.append(("tracker.log", step))
        self.logged.append((step, dict(metrics), total))


class FakeProgress:
    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k


def _plan(**overrides) -> LoopPlan:
    values = dict(start=0, num_rollout=4, num_rollout_per_epoch=2, eval_interval=2, save_interval=None,
                  offload=False, has_eval=True)
    values.update(overrides)
    return LoopPlan(**values)


def _run(plan: LoopPlan):
    calls: list = []
    tracker = FakeTracker(calls)
    progress = FakeProgress()
    run_loop(plan, FakeTrainer(calls), FakeRollout(calls), FakeCheckpointer(calls), tracker, progress=progress)
    return calls, tracker, progress


def _save(k):
    return [("ckpt.stage", k), ("trainer.save", f"stage{k}"), ("rollout.save_state", f"stage{k}"), ("ckpt.commit", k)]


def test_call_order_without_offload():
    calls, tracker, progress = _run(_plan())
    expected = [("trainer.push_weights", 0), ("rollout.prepare_data",), ("rollout.eval", 0), ("tracker.log", 0)]
    for k in range(4):
        expected += [("rollout.generate", k), ("trainer.train", k, f"batch{k}")]
        if k in (1, 3):  # epoch ends
            expected += _save(k)
        expected += [("trainer.push_weights", k + 1)]
        if k in (1, 3):  # (k + 1) % eval_interval == 0, and the last rollout
            expected += [("rollout.eval", k + 1)]
        expected += [("tracker.log", k + 1)]
    assert calls == expected
    assert progress.n == 4


def test_saves_happen_at_epoch_ends():
    calls, _, _ = _run(_plan())
    assert [c[1] for c in calls if c[0] == "ckpt.commit"] == [1, 3]
    assert [c[1] for c in calls if c[0] == "ckpt.stage"] == [1, 3]


def test_tracker_steps_and_metrics():
    _, tracker, _ = _run(_plan())
    assert [step for step, _, _ in tracker.logged] == [0, 1, 2, 3, 4]
    assert all(total == 4 for _, _, total in tracker.logged)
    with_eval = [step for step, metrics, _ in tracker.logged if "eval/add/score" in metrics]
    assert with_eval == [0, 2, 4]
    step0 = tracker.logged[0][1]
    assert step0["timing/weight_sync_s"] == 0.5 and "weight_sync/seconds" not in step0
    assert "train/loss" not in step0
    for step, metrics, _ in tracker.logged[1:]:
        assert metrics["train/loss"] == float(step - 1)
        assert metrics["rollout/reward"] == 1.0
        assert metrics["timing/weight_sync_s"] == 0.5 and "weight_sync/seconds" not in metrics
        assert metrics["weight_sync/bytes"] == 10.0
        assert metrics["timing/rollout_s"] >= 0
        assert ("timing/save_s" in metrics) == (step in (2, 4))


def test_call_order_with_offload():
    calls, _, _ = _run(_plan(offload=True))

    def sync(version):
        return [("trainer.offload",), ("rollout.onload", [W]), ("trainer.push_weights", version),
                ("rollout.onload", [KV])]

    expected = sync(0) + [("rollout.prepare_data",), ("rollout.eval", 0), ("tracker.log", 0)]
    for k in range(4):
        expected += [("rollout.generate", k), ("rollout.offload", [W, KV]), ("trainer.onload",),
                     ("trainer.train", k, f"batch{k}")]
        if k in (1, 3):
            expected += _save(k)  # the trainer saves while it is on the device
        expected += sync(k + 1)
        if k in (1, 3):
            expected += [("rollout.eval", k + 1)]
        expected += [("tracker.log", k + 1)]
    assert calls == expected


def test_sync_weights_returns_push_metrics():
    calls: list = []
    metrics = sync_weights(FakeTrainer(calls), FakeRollout(calls), 3, offload=False)
    assert calls == [("trainer.push_weights", 3)]
    assert metrics == {"weight_sync/seconds": 0.5, "weight_sync/bytes": 10.0}


def test_resume_skips_baseline_and_runs_remaining_rollouts():
    calls, tracker, progress = _run(_plan(start=2))
    # Engines get the checkpoint's policy (version = start) before generating; no baseline eval or log.
    assert calls[0] == ("trainer.push_weights", 2)
    assert calls[1] == ("rollout.generate", 2)
    assert [c[1] for c in calls if c[0] == "rollout.generate"] == [2, 3]
    assert [c[1] for c in calls if c[0] == "trainer.push_weights"] == [2, 3, 4]
    assert [c[1] for c in calls if c[0] == "rollout.eval"] == [4]
    assert [c[1] for c in calls if c[0] == "ckpt.commit"] == [3]
    assert [step for step, _, _ in tracker.logged] == [3, 4]
    assert progress.n == 2


def test_resume_after_the_last_rollout_only_pushes_weights():
    calls, tracker, _ = _run(_plan(start=4))
    assert calls == [("trainer.push_weights", 4)]
    assert tracker.logged == []


def test_no_eval_datasets_never_evaluates_but_logs_baseline():
    calls, tracker, _ = _run(_plan(has_eval=False))
    assert not [c for c in calls if c[0] == "rollout.eval"]
    assert [step for step, _, _ in tracker.logged] == [0, 1, 2, 3, 4]


def test_save_interval_adds_saves():
    calls, _, _ = _run(_plan(num_rollout=6, num_rollout_per_epoch=4, save_interval=3))
    # Interval (2, 5), epoch end (3), last rollout (5).
    assert [c[1] for c in calls if c[0] == "ckpt.commit"] == [2, 3, 5]


# --------------------------------------------------------------------------- #
# LoopPlan
# --------------------------------------------------------------------------- #


def test_eval_due():
    plan = _plan(num_rollout=5, eval_interval=2)
    assert [k for k in range(5) if plan.eval_due(k)] == [1, 3, 4]  # 4: the last rollout is always evaluated


def test_eval_due_interval_larger_than_run():
    plan = _plan(num_rollout=3, eval_interval=10)
    assert [k for k in range(3) if plan.eval_due(k)] == [2]


@pytest.mark.parametrize("overrides", [dict(has_eval=False), dict(eval_interval=None),
                                       dict(has_eval=False, eval_interval=1)])
def test_eval_never_due_without_datasets_or_interval(overrides):
    plan = _plan(**overrides)
    assert not any(plan.eval_due(k) for k in range(plan.num_rollout))


def test_save_due():
    plan = _plan(num_rollout=7, num_rollout_per_epoch=3, save_interval=None)
    assert [k for k in range(7) if plan.save_due(k)] == [2, 5, 6]  # epoch ends and the last rollout
    plan = _plan(num_rollout=7, num_rollout_per_epoch=10, save_interval=2)
    assert [k for k in range(7) if plan.save_due(k)] == [1, 3, 5, 6]
    plan = _plan(num_rollout=1, num_rollout_per_epoch=5, save_interval=None)
    assert plan.save_due(0)


class FakeStartup:
    def __init__(self, calls: list):
        self.calls = calls

    def lap(self, name, detail=""):
        self.calls.append(("startup.lap", name))
        return 0.0

    def metrics(self):
        return {"startup/total_s": 1.0}

    def report(self):
        self.calls.append(("startup.report",))


@pytest.mark.parametrize("start", [0, 2])
def test_startup_is_timed_through_the_first_push_and_eval_then_printed_once(start):
    calls: list = []
    tracker = FakeTracker(calls)
    run_loop(_plan(start=start), FakeTrainer(calls), FakeRollout(calls), FakeCheckpointer(calls), tracker,
             startup=FakeStartup(calls))
    head = calls[:calls.index(("rollout.generate", start))]
    if start == 0:
        assert head == [("trainer.push_weights", 0), ("startup.lap", "first weight push"), ("rollout.prepare_data",),
                        ("rollout.eval", 0),
                        ("startup.lap", "eval at step 0"), ("startup.report",), ("tracker.log", 0)]
        assert tracker.logged[0][1]["startup/total_s"] == 1.0
    else:  # a resumed run has no baseline eval to time
        assert head == [("trainer.push_weights", start), ("startup.lap", "first weight push"), ("startup.report",)]
    assert calls.count(("startup.report",)) == 1
