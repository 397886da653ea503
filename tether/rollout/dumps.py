"""What a run writes about its rollouts and evals (``debug.save_rollouts``, default <output_dir>/rollouts):
rollout_<id>.jsonl (every field needed to train on it again), eval_<set>_<id>.jsonl with its answers and
per-prompt pass rates, and the stale groups a fully async run dropped. Only the newest
``debug.keep_rollout_dumps`` of each kind stay during `tether train`, so a long run cannot fill the disk."""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from pathlib import Path

from tether.sample import Sample


class Dumps:
    def __init__(self, directory: Path, keep: int | None):
        self.dir, self.keep = directory, keep
        self.prune = True  # `tether rollout` turns it off: it exists to keep them

    def rows(self, rows: list[dict], name: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / name, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    def samples(self, samples: list[Sample], name: str) -> None:
        self.rows([s.to_dict() for s in samples], name)

    def answers(self, samples: list[Sample], answers: Counter, name: str) -> None:
        """Per-answer counts and mean rewards of one eval, most common first."""
        rewards: dict[str, list[float]] = {}
        for s in samples:
            rewards.setdefault(s.response_text.strip(), []).append(s.scored_reward())
        rows = [{"answer": a, "count": c, "mean_reward": statistics.fmean(rewards[a])} for a, c in answers.most_common()]
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / name).write_text(json.dumps(rows, indent=1) + "\n")

    def prune_old(self, prefix: str) -> None:
        """Keep the files of the newest ``keep`` rollouts (or evals) named ``prefix<id>``."""
        if self.keep is None or not self.prune:
            return
        pattern = re.compile(re.escape(prefix) + r"(\d{6})(_[a-z_]+)?\.jsonl?$")
        by_id: dict[int, list[Path]] = {}
        for path in self.dir.glob(prefix + "*"):
            match = pattern.match(path.name)
            if match:
                by_id.setdefault(int(match.group(1)), []).append(path)
        for old in sorted(by_id)[:-self.keep]:
            for path in by_id[old]:
                path.unlink(missing_ok=True)
