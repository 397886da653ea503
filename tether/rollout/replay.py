"""Training on saved rollouts (``debug.load_rollouts``): the Rollout the loop drives, without engines.

Rollout k is read from ``rollout_<k>.jsonl`` (what every run and ``tether rollout`` write) and handed
to the trainer as the live rollout would have been, so a deterministic run trained on a saved rollout
reaches the same weights as the run that generated it. Useful to debug the trainer on a fixed batch,
to compare algorithms on the same samples, or to train on rollouts generated elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray

from tether.config import ConfigError, TetherConfig
from tether.rollout.manager import DATA_STATE
from tether.rollout.results import rollout_metrics, to_train_batch, trajectory_layout
from tether.sample import sample_from_dict


def rollout_file(directory: Path, rollout_id: int) -> Path:
    return directory / f"rollout_{rollout_id:06d}.jsonl"


class ReplayRollout:
    def __init__(self, cfg: TetherConfig):
        self.cfg = cfg
        assert cfg.debug.load_rollouts is not None  # train.py replays only when it is set
        self.dir = Path(cfg.debug.load_rollouts)
        self.count = 0
        while rollout_file(self.dir, self.count).is_file():
            self.count += 1
        if self.count == 0:
            raise ConfigError(f"debug.load_rollouts: {self.dir} holds no rollout_000000.jsonl")
        self.info: dict[str, Any] = {"train_rows": 0, "warnings": [
            f"training on the {self.count} rollout(s) saved in {self.dir}; no engines, no eval"]}

    def num_rollout_per_epoch(self) -> int:
        return self.count

    def generate(self, rollout_id: int) -> tuple[Any, dict[str, float]]:
        path = rollout_file(self.dir, rollout_id)
        if not path.is_file():
            raise ConfigError(f"debug.load_rollouts: {path} does not exist (the directory holds rollouts "
                              f"0..{self.count - 1}; set rollout.num_rollout to at most {self.count})")
        samples = []
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    samples.append(sample_from_dict(json.loads(line)))
                except (ValueError, TypeError) as err:
                    raise ConfigError(f"{path}:{line_no}: not a saved sample ({err})") from None
        r = self.cfg.rollout
        groups: dict[int, list] = {}
        for sample in samples:  # in file order: a group's samples, a trajectory's segments, adjacent
            groups.setdefault(sample.group_index, []).append(sample)
        try:
            size, trajectories = trajectory_layout(list(groups.values()), self.cfg)
            batch = to_train_batch(samples, size, r.temperature, trajectories)
            batch.validate()
        except ValueError as err:
            raise ConfigError(f"{path}: {err}") from None
        return ray.put(batch), {**rollout_metrics(samples), "timing/generate_s": 0.0}

    def eval(self, rollout_id: int) -> dict:
        return {}

    def prepare_data(self) -> dict:
        return {}  # the saved rollouts are what is trained on

    def save_state(self, ckpt_dir: str) -> None:
        # The checkpoint stays complete (it is looked for); a resume reads rollout files by id.
        (Path(ckpt_dir) / DATA_STATE).write_text(json.dumps({"replay": str(self.dir)}))

    def load_state(self, ckpt_dir: str) -> dict:
        return {}

    def offload(self, tags: list[str]) -> None:
        pass

    def onload(self, tags: list[str]) -> None:
        pass

    def replace_engines(self, indices: list[int], reason: str) -> float:
        raise RuntimeError(f"a replayed run has no engines to replace ({reason})")

    def shutdown(self) -> None:
        pass


class WithoutEngines:
    """The trainer, for a loop with no engines to push weights to."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def push_weights(self, version: int) -> dict[str, float]:
        return {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)
