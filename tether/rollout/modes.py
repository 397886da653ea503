"""The rollout manager's side of rollout.schedule, picked once from its mode (the loop's side is
train.LOOPS): what the manager keeps between rollouts, and how a rollout's groups come to it.

- ``BatchMode`` (sync, one_step_off): each rollout is produced when the loop asks for it, by the
  rollout function (tether/rollout/builtin.py or the user's); nothing runs between rollouts.
- ``StreamMode`` (fully_async): groups stream through the engines across train steps
  (tether/rollout/stream.py); a take hands the trainer the next finished ones, and the stream's
  position and its groups drawn and not yet trained on are part of a checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable

from tether.errors import ConfigError
from tether.rollout.config import FullyAsyncSchedule, Schedule
from tether.rollout.stream import Flight, RolloutStream, StreamSettings, staleness_metrics


class BatchMode:
    """sync and one_step_off: no state between rollouts beyond the data source's."""

    streams = False

    def connect(self, **parts: Any) -> None:
        pass

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None, data_state: dict) -> None:
        if state is not None:
            raise ConfigError("this checkpoint was saved by a fully asynchronous run (it holds the groups drawn "
                              "and not yet trained on): resume it with rollout.schedule.mode: fully_async")

    def close(self) -> None:
        pass


class StreamMode:
    """fully_async: the stream, started once the engines are connected."""

    streams = True

    def __init__(self, schedule: FullyAsyncSchedule, settings: Callable[[FullyAsyncSchedule], StreamSettings]):
        self.settings = settings(schedule)
        self.stream: RolloutStream | None = None

    def connect(self, *, fleet: Any, data: Any, params: Any, score: Any, keep: Any, custom: Any) -> None:
        if data is not None:  # a manager without prompt data only evaluates
            self.stream = RolloutStream(fleet, data, params, self.settings, score, keep, custom)

    def require(self) -> RolloutStream:
        if self.stream is None:
            raise RuntimeError("the rollout stream starts with the engines (connect_engines) and needs prompt data")
        return self.stream

    def take(self, rollout_id: int) -> tuple[list[Flight], dict[str, float], list[Flight], list[dict]]:
        """The next rollout's groups (numbered as placed in the trained batch), their metrics, the
        stale groups dropped since the last take and the samples that failed since (for the record)."""
        stream = self.require()
        flights, metrics = stream.take(rollout_id)
        groups = [f.samples for f in flights]
        for k, group in enumerate(groups):  # a group's index is its place in the trained batch
            for s in group:
                s.group_index, s.rollout_id = k, rollout_id
        metrics.update(staleness_metrics(groups, rollout_id))
        dropped = list(stream.dropped)
        stream.dropped.clear()
        return flights, metrics, dropped, stream.taken_failures.rows

    def state_dict(self) -> dict | None:
        return self.stream.state_dict() if self.stream is not None else None

    def load_state_dict(self, state: dict | None, data_state: dict) -> None:
        """A synchronous checkpoint (no stream state) starts the stream at its data position."""
        self.require().load_state_dict(state if state is not None else {
            "position": [data_state["epoch"], data_state["offset"]], "next_seq": 0, "totals": {}, "ready": [],
            "pending": []})

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def make_mode(schedule: Schedule, settings: Callable[[FullyAsyncSchedule], StreamSettings]) -> BatchMode | StreamMode:
    """``settings``: the stream's settings from the schedule (the rest come from the run's config)."""
    return StreamMode(schedule, settings) if isinstance(schedule, FullyAsyncSchedule) else BatchMode()
