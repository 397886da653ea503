"""tether.loop_async.run_one_step_off with in-process fakes: what overlaps, the staleness bound, the
drain before checkpoints and evals, and that a resumed run repeats the uninterrupted run's calls."""

from __future__ import annotations

import pytest

from tests.unit.test_loop import FakeCheckpointer, FakeProgress, FakeRollout, FakeTracker, FakeTrainer, _plan
from tether.loop_async import overlaps, run_fully_async, run_one_step_off


class Pending:
    def __init__(self, rollout: AsyncFakeRollout, rollout_id: int):
        self.rollout, self.rollout_id = rollout, rollout_id

    def result(self):
        self.rollout.calls.append(("pending.result", self.rollout_id))
        self.rollout.in_flight.remove(self.rollout_id)
        return f"batch{self.rollout_id}", {"rollout/reward": 1.0, "weight_version": self.rollout.version}


class AsyncFakeRollout(FakeRollout):
    """Engines that remember the weight version they generate under, and what is in flight."""

    def __init__(self, calls: list):
        super().__init__(calls)
        self.version = -1
        self.in_flight: list[int] = []

    def generate(self, rollout_id):
        assert not self.in_flight
        batch, metrics = super().generate(rollout_id)
        return batch, {**metrics, "weight_version": self.version}

    def submit_generate(self, rollout_id):
        self.calls.append(("rollout.submit_generate", rollout_id))
        self.in_flight.append(rollout_id)
        return Pending(self, rollout_id)


class VersionedTrainer(FakeTrainer):
    def __init__(self, calls: list, rollout: AsyncFakeRollout):
        super().__init__(calls)
        self.rollout = rollout

    def push_weights(self, version):
        assert not self.rollout.in_flight, "weights pushed under a rollout in flight"
        self.rollout.version = version
        return super().push_weights(version)


def run(plan):
    calls: list = []
    rollout = AsyncFakeRollout(calls)
    tracker = FakeTracker(calls)
    run_one_step_off(plan, VersionedTrainer(calls, rollout), rollout, FakeCheckpointer(calls), tracker,
                     progress=FakeProgress())
    return calls, tracker


def test_the_next_rollout_generates_during_the_train_step_one_version_behind():
    plan = _plan(num_rollout=5, num_rollout_per_epoch=100, eval_interval=None, has_eval=False)
    calls, tracker = run(plan)
    expected = [("trainer.push_weights", 0), ("rollout.prepare_data",), ("tracker.log", 0), ("rollout.generate", 0)]
    for k in range(5):
        if k + 1 < 5:
            expected += [("rollout.submit_generate", k + 1)]
        expected += [("trainer.train", k, f"batch{k}")]
        if k == 4:
            expected += [("ckpt.stage", 4), ("trainer.save", "stage4"), ("rollout.save_state", "stage4"),
                         ("ckpt.commit", 4)]
        else:
            expected += [("pending.result", k + 1)]
        expected += [("trainer.push_weights", k + 1), ("tracker.log", k + 1)]
    assert calls == expected
    rows = {step: metrics for step, metrics, _ in tracker.logged}
    # Rollout k trains the update to version k+1 from samples of version k-1 (0 for the first).
    assert [rows[k + 1]["weight_version"] for k in range(5)] == [0, 0, 1, 2, 3]
    assert [rows[k + 1]["async/staleness"] for k in range(5)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    for k in range(5):  # never more than one version behind the weights being trained
        assert (k - rows[k + 1]["weight_version"]) <= 1
    assert all("timing/generate_wait_s" in rows[k + 1] for k in range(4))


def test_checkpoints_and_evals_drain_the_pipeline():
    plan = _plan(num_rollout=6, num_rollout_per_epoch=100, save_interval=2, eval_interval=3)
    assert [overlaps(plan, k) for k in range(6)] == [True, False, False, False, True, False]
    calls, tracker = run(plan)
    # After train(1) a checkpoint follows: rollout 2 is generated only after version 2 is pushed.
    after_save = calls[calls.index(("ckpt.commit", 1)):]
    assert after_save[:4] == [("ckpt.commit", 1), ("trainer.push_weights", 2), ("tracker.log", 2),
                              ("rollout.generate", 2)]
    # After train(2) an eval follows: it sees version 3, with nothing in flight.
    at_eval = calls.index(("rollout.eval", 3))
    assert calls[at_eval - 1] == ("trainer.push_weights", 3) and ("rollout.submit_generate", 3) not in calls
    rows = {step: metrics for step, metrics, _ in tracker.logged}
    assert [rows[k + 1]["async/staleness"] for k in range(6)] == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("resume_at", [2, 4])
def test_a_resumed_run_makes_the_uninterrupted_runs_calls(resume_at):
    """Resuming from the checkpoint after rollout resume_at - 1 (where the pipeline drained) repeats,
    call for call, what the uninterrupted run did from its push of version resume_at on."""
    whole, _ = run(_plan(num_rollout=6, num_rollout_per_epoch=100, save_interval=2, has_eval=False))
    resumed, _ = run(_plan(start=resume_at, num_rollout=6, num_rollout_per_epoch=100, save_interval=2,
                           has_eval=False))
    tail = whole[whole.index(("trainer.push_weights", resume_at)):]
    assert [c for c in tail if c[0] != "tracker.log"] == [c for c in resumed if c[0] != "tracker.log"]


@pytest.mark.parametrize("fields, words", [
    ({"rollout": {"schedule": {"mode": "one_step_off"}}}, ["rollout.schedule.mode: one_step_off",
                                                            "cluster.colocate=false"]),
    ({"rollout": {"schedule": {"mode": "one_step_off", "max_staleness": 2}}, "cluster": {"colocate": False}},
     ["rollout.schedule.one_step_off.max_staleness", "unknown field"]),
    ({"rollout": {"schedule": {"mode": "one_step_off"}}, "cluster": {"colocate": False},
      "debug": {"load_rollouts": "x"}}, ["rollout.schedule.mode: one_step_off", "debug.load_rollouts"]),
    ({"rollout": {"schedule": {"mode": "fully_async", "max_staleness": 0}}, "cluster": {"colocate": False}},
     ["rollout.schedule.fully_async.max_staleness", "greater than or equal to 1"]),
    ({"rollout": {"schedule": {"mode": "fully_async", "max_staleness": 2}, "custom_rollout_fn": "m:f"},
      "cluster": {"colocate": False}}, ["fully_async", "rollout.custom_rollout_fn=m:f", "whole rollout"]),
    ({"rollout": {"schedule": {"mode": "fully_async", "max_staleness": 2}, "keep_order": "finish",
                  "partial_rollout": True},
      "cluster": {"colocate": False}}, ["fully_async", "rollout.keep_order=finish", "oldest weights first"]),
    ({"rollout": {"schedule": {"mode": "fully_async", "max_staleness": 2}}, "cluster": {"colocate": False},
      "deterministic": True}, ["fully_async", "deterministic=True"]),
    ({"rollout": {"schedule": {"mode": "fully_async", "stale_groups": "keep"}},
      "cluster": {"colocate": False}}, ["rollout.schedule.fully_async.stale_groups", "keep"]),
    ({"rollout": {"schedule": {"max_staleness": 2}}, "cluster": {"colocate": False}},
     ["rollout.schedule needs its mode", "fully_async"]),
])
def test_configs_that_cannot_overlap_are_refused_naming_the_fields(tmp_path, fields, words):
    from tether.config import ConfigError, config_from_dict

    raw = {"model": {"path": str(tmp_path)}, "data": {"path": str(tmp_path / "d.jsonl")}}
    for section, values in fields.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert all(word in str(err.value) for word in words), str(err.value)


def test_perf_metrics():
    from tether.loop import perf_metrics

    assert perf_metrics(2.0, 0.5, 1.5, 64.0) == {"perf/samples_per_s": 32.0, "perf/train_idle_frac": 0.75,
                                                 "perf/rollout_idle_frac": 0.25}
    assert perf_metrics(1.0, None, None, None) == {}
    assert perf_metrics(1.0, 3.0, 0.0, None)["perf/train_idle_frac"] == 0.0  # never negative


def test_engine_time_counts_in_the_iteration_it_ran(monkeypatch):
    """An overlapped rollout's generation counts in the iteration during which it ran (the one before
    it trains), a synchronous one in its own."""
    import tether.loop

    seen = []
    monkeypatch.setattr(tether.loop, "perf_metrics", lambda it, train, gen, samples: seen.append(gen) or {})

    class Timed(AsyncFakeRollout):
        def generate(self, rollout_id):
            batch, metrics = super().generate(rollout_id)
            return batch, {**metrics, "timing/generate_s": 10.0 + rollout_id}

        def submit_generate(self, rollout_id):
            pending = super().submit_generate(rollout_id)
            inner = pending.result
            pending.result = lambda: (lambda b, m: (b, {**m, "timing/generate_s": 10.0 + rollout_id}))(*inner())
            return pending

    calls: list = []
    rollout = Timed(calls)
    plan = _plan(num_rollout=4, num_rollout_per_epoch=100, save_interval=2, has_eval=False)
    run_one_step_off(plan, VersionedTrainer(calls, rollout), rollout, FakeCheckpointer(calls), FakeTracker(calls))
    # 0: generates 0 and, overlapped, 1; 1: drains (save); 2: generates 2 and 3; 3: nothing new.
    assert seen == [10.0 + 11.0, 0.0, 12.0 + 13.0, 0.0]


class StreamFakeRollout(FakeRollout):
    """A stream: takes, pauses and resumes; weights may only be pushed while it is paused."""

    def __init__(self, calls: list):
        super().__init__(calls)
        self.paused = True

    def start_stream(self, version, next_take):
        self.calls.append(("rollout.start_stream", version, next_take))
        self.paused = False

    def take(self, rollout_id):
        assert not self.paused
        self.calls.append(("rollout.take", rollout_id))
        return f"batch{rollout_id}", {"async/engine_busy_s": 0.25, "rollout/samples": 8.0}

    def pause(self):
        self.calls.append(("rollout.pause",))
        self.paused = True

    def resume(self, version):
        self.calls.append(("rollout.resume", version))
        self.paused = False


class PausedOnlyTrainer(FakeTrainer):
    def __init__(self, calls: list, rollout: StreamFakeRollout):
        super().__init__(calls)
        self.rollout = rollout

    def push_weights(self, version):
        started = any(c[0] == "rollout.start_stream" for c in self.calls)
        assert self.rollout.paused or not started, "weights pushed while the stream generates"
        return super().push_weights(version)


def test_fully_async_takes_trains_and_pushes_while_paused_without_draining():
    calls: list = []
    rollout = StreamFakeRollout(calls)
    tracker = FakeTracker(calls)
    plan = _plan(num_rollout=4, num_rollout_per_epoch=100, save_interval=2, eval_interval=2)
    run_fully_async(plan, PausedOnlyTrainer(calls, rollout), rollout, FakeCheckpointer(calls), tracker,
                    progress=FakeProgress())
    expected = [("trainer.push_weights", 0), ("rollout.prepare_data",), ("rollout.eval", 0), ("tracker.log", 0),
                ("rollout.start_stream", 0, 0)]
    for k in range(4):
        expected += [("rollout.take", k), ("trainer.train", k, f"batch{k}")]
        if k in (1, 3):  # the checkpoint does not stop the stream: its state is saved as it is
            expected += [("ckpt.stage", k), ("trainer.save", f"stage{k}"), ("rollout.save_state", f"stage{k}"),
                         ("ckpt.commit", k)]
        expected += [("rollout.pause",), ("trainer.push_weights", k + 1), ("rollout.resume", k + 1)]
        if k in (1, 3):  # evals run beside the stream, on the new weights
            expected += [("rollout.eval", k + 1)]
        expected += [("tracker.log", k + 1)]
    expected += [("rollout.pause",)]
    assert calls == expected
    rows = {step: metrics for step, metrics, _ in tracker.logged}
    assert all(0 <= rows[k]["perf/rollout_idle_frac"] <= 1 and rows[k]["perf/samples_per_s"] > 0 for k in range(1, 5))


def test_a_resumed_fully_async_run_starts_the_stream_where_it_stopped():
    calls: list = []
    rollout = StreamFakeRollout(calls)
    plan = _plan(start=3, num_rollout=5, num_rollout_per_epoch=100, has_eval=False)
    run_fully_async(plan, PausedOnlyTrainer(calls, rollout), rollout, FakeCheckpointer(calls), FakeTracker(calls))
    assert calls[:3] == [("trainer.push_weights", 3), ("rollout.start_stream", 3, 3), ("rollout.take", 3)]
