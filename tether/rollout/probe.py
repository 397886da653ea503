"""The probe: the starting model's pass rate of problems, measured with the run's own engines and reward
before the first rollout (data.difficulty), cached so that a restarted run measures each problem once.

Problems are generated in chunks (``probe_samples`` samples each, the rollout's sampling settings, the
run's reward); after each chunk its problems' results are appended to <output_dir>/difficulty/
pass_rates.jsonl, one line a problem, keyed by a hash of its prompt and label, and a progress line is
printed. A restarted run reads the file back and measures only what is missing.

With a curriculum starting at ``probe``, the levels are probed upward, all tasks at once: level 0 of
every task, then level 1 of the tasks whose level 0 reached ``start_pass``, and so on; a task starts at
the last level that reached it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from tether.rollout.data_source import PromptRow
from tether.rollout.difficulty import AdaptiveSource, prompt_hash, row_level, row_task
from tether.sample import Sample

CHUNK = 64
"""Problems generated together: one engine batch, and what a restart can lose."""
DIFFICULTY_DIR = "difficulty"
"""Under the run's output_dir: the probe's cache and the summary of what was kept."""
CACHE = "pass_rates.jsonl"
SUMMARY = "summary.json"


def write_summary(folder: Path, rows: list[dict]) -> None:
    """Per task and level (AdaptiveSource.summary): written beside the cache, and printed as a table."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SUMMARY).write_text(json.dumps(rows, indent=1))
    print("[tether] data.difficulty: " + "; ".join(summary_line(r) for r in rows), file=sys.stderr)


def summary_line(row: dict) -> str:
    level = f" level {row['level']}{' (current)' if row.get('current') else ''}" if row.get("current") is not None else ""
    rate = f", pass rate {row['pass_rate']:.2f} over {row['measured']} measured" if row["measured"] else ""
    return (f"{row['task'] or 'data'}{level}: {row['in_band']} of {row['problems']} problems in the band{rate}"
            + (f" ({row['never']} never solved, {row['always']} always)" if row["measured"] else ""))

Generate = Callable[[list[list[Sample]], int], list[list[Sample]]]
"""(groups, chunk number) -> the groups generated and scored (the manager runs them on its engines)."""


class Probe:
    def __init__(self, source: AdaptiveSource, generate: Generate, folder: Path):
        self.source, self.generate = source, generate
        self.path = folder / CACHE
        self.cached: dict[str, tuple[float, int]] = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.cached[row["hash"]] = (float(row["passes"]), int(row["samples"]))
        self.chunks = 0
        self.measured = 0
        self.seconds = 0.0
        self.rates: dict[int, float] = {}
        """The pass rates of the last ``measure``'s rows."""
        self.levels: dict[str, int] = {}
        """The starting levels ``start_levels`` found."""

    def measure(self, indices: list[int], what: str) -> Iterator[None]:
        """Measure these rows (each recorded into the source; cached ones are not generated again),
        yielding after each chunk; ``self.rates`` then holds their pass rates."""
        rows = [self.source.rows[i] for i in dict.fromkeys(indices)]
        todo = [r for r in rows if prompt_hash(r) not in self.cached]
        n = self.source.cfg.probe_samples
        start = time.perf_counter()
        if todo:
            print(f"[tether] probe ({what}): {len(todo)} problems x {n} samples"
                  + (f" ({len(rows) - len(todo)} measured before)" if len(todo) < len(rows) else ""), file=sys.stderr)
        done = 0
        for k in range(0, len(todo), CHUNK):
            chunk = todo[k : k + CHUNK]
            groups = self.generate([self.source.group(row, j, n) for j, row in enumerate(chunk)], self.chunks)
            self.chunks += 1
            self._save(chunk, groups)
            done += len(chunk)
            rate = statistics.fmean(p / s for p, s in (self.cached[prompt_hash(r)] for r in todo[:done]) if s)
            print(f"[tether] probe ({what}): {done}/{len(todo)} problems, mean pass rate {rate:.2f}, "
                  f"{time.perf_counter() - start:.0f}s", file=sys.stderr)
            self.seconds += time.perf_counter() - start
            start = time.perf_counter()
            yield
        self.rates = {}
        for row in rows:
            passes, samples = self.cached[prompt_hash(row)]
            self.source.record(row.index, passes, samples)
            self.rates[row.index] = passes / samples if samples else 0.0

    def _save(self, rows: list[PromptRow], groups: list[list[Sample]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for row, group in zip(rows, groups):
            scored = [s for s in group if not s.failed]
            passes = float(sum(self.source.cfg.passed(s.scored_reward()) for s in scored))
            self.cached[prompt_hash(row)] = (passes, len(scored))
            lines.append(json.dumps({"hash": prompt_hash(row), "index": row.index, "line": row.line,
                                     "task": row_task(row), "level": row_level(row), "passes": passes,
                                     "samples": len(scored),
                                     "rewards": [None if s.failed else s.scored_reward() for s in group]}))
        with self.path.open("a") as f:  # one write per chunk: a crash loses at most the chunk in flight
            f.write("\n".join(lines) + "\n")
        self.measured += len(rows)

    def start_levels(self) -> Iterator[None]:
        """Each task's starting level into ``self.levels``, probed upward from its lowest (curriculum start:
        probe), yielding after each chunk."""
        c = self.source.cfg.curriculum
        assert c is not None and c.start == "probe"
        source = self.source
        level = {task: source.state.levels[task] for task in source.tasks}
        climbing = set(source.tasks)
        while climbing:
            picks = {task: self._first(task, level[task], c.probe_problems) for task in climbing}
            yield from self.measure([i for rows in picks.values() for i in rows],
                                    "levels " + ", ".join(f"{t or 'data'} {level[t]}" for t in sorted(climbing)))
            for task in sorted(climbing):
                passed = statistics.fmean(self.rates[i] for i in picks[task]) >= c.start_pass
                higher = [lv for t, lv in source.pools if t == task and lv > level[task]]
                if passed and higher:
                    level[task] = min(higher)
                    continue
                if not passed and level[task] > source.state.levels[task]:
                    level[task] = max(lv for t, lv in source.pools if t == task and lv < level[task])
                climbing.discard(task)
        self.levels = level

    def _first(self, task: str, level: int, count: int) -> list[int]:
        """The first ``count`` problems of a pool in its draw order (those training would meet first)."""
        members = self.source.pools[(task, level)]
        order = self.source.pool_order((task, level), 0)
        return [members[int(i)] for i in order[:count]]
