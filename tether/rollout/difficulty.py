"""Prompts drawn where the model has signal: a pass rate per problem, the band of rates trained on, and
a curriculum of levels per task (data.difficulty; the section is in difficulty_config.py).

``AdaptiveSource`` is a data source like ``DataSource`` (the rollout draws groups with ``peek_groups`` and
commits them with ``advance``), over *pools*: the rows of one task at one level (rows carry
``metadata.task`` and ``metadata.level``; a file without them is one pool). Slots go to tasks in turn,
so every rollout mixes the tasks evenly, and each task draws from its current level's pool in a seeded
order, skipping problems whose measured pass rate is outside the band. After each rollout ``observe``
records every trained group's pass rate (its problem's, and its task's recent ones), and a task whose
recent pass rate reaches ``raise_at`` moves up a level. Everything a resumed run needs to draw exactly
the same problems is in ``state_dict``.

What is measured before the run (the probe, probe.py) comes in through ``record`` and ``start_at``.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from tether.rollout.data_source import DataSource, PromptRow
from tether.rollout.difficulty_config import DifficultyConfig
from tether.sample import Sample


def row_task(row: PromptRow) -> str:
    return str(row.metadata.get("task", "")) if isinstance(row.metadata, dict) else ""


def row_level(row: PromptRow) -> int:
    level = row.metadata.get("level", 0) if isinstance(row.metadata, dict) else 0
    return int(level) if isinstance(level, int) else 0


def prompt_hash(row: PromptRow) -> str:
    """What identifies a problem in the probe's cache: its prompt tokens and label."""
    return hashlib.sha256(repr((row.prompt_ids, row.label)).encode()).hexdigest()[:16]


@dataclass
class DrawState:
    """Where the draws stand: slots handed out, each pool's (epoch, offset), each task's level."""

    draws: int = 0
    cursors: dict[str, list[int]] = field(default_factory=dict)
    levels: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    """Problems passed over as outside the band, in all."""

    def copy(self) -> DrawState:
        return DrawState(self.draws, {k: list(v) for k, v in self.cursors.items()}, dict(self.levels), self.skipped)


class AdaptiveSource(DataSource):
    """A DataSource that draws each task's problems from its current level, inside the band."""

    def __init__(self, rows: list[PromptRow], cfg: DifficultyConfig, *, prompts_per_rollout: int,
                 n_samples_per_prompt: int, shuffle: bool, seed: int) -> None:
        super().__init__(rows, prompts_per_rollout=prompts_per_rollout, n_samples_per_prompt=n_samples_per_prompt,
                         shuffle=shuffle, seed=seed)
        self.cfg = cfg
        self.pools: dict[tuple[str, int], list[int]] = {}
        for row in rows:
            level = row_level(row) if cfg.curriculum is not None else 0
            self.pools.setdefault((row_task(row), level), []).append(row.index)
        self.tasks = list(dict.fromkeys(task for task, _ in self.pools))
        self.top = {task: max(level for t, level in self.pools if t == task) for task in self.tasks}
        self.rates: dict[int, tuple[float, int]] = {}
        """Row index -> (passes, samples): probed before the run, then (with update) each trained group."""
        self.recent: dict[str, list[float]] = {task: [] for task in self.tasks}
        """Each task's pass rates of its groups trained since its level last changed."""
        self.state = DrawState(levels={task: self._lowest(task) for task in self.tasks})
        self.changes: list[str] = []
        """Level changes not yet reported (taken by metrics())."""

    def _lowest(self, task: str) -> int:
        return min(level for t, level in self.pools if t == task)

    # ------------------------------------------------------------ drawing
    def pool_order(self, pool: tuple[str, int], epoch: int) -> np.ndarray:
        size = len(self.pools[pool])
        if not self.shuffle:
            return np.arange(size)
        key = int.from_bytes(hashlib.sha256(f"{pool[0]}/{pool[1]}".encode()).digest()[:4], "big")
        return np.random.default_rng([self.seed, key, epoch]).permutation(size)

    def in_band(self, index: int) -> bool:
        """A problem's measured pass rate is inside the band (or it has none yet)."""
        if index not in self.rates:
            return True
        passes, samples = self.rates[index]
        low, high = self.cfg.band
        return samples == 0 or low < passes / samples < high

    def _pool_of(self, task: str, state: DrawState) -> tuple[str, int]:
        level = state.levels[task]
        while (task, level) not in self.pools:  # a level with no rows (a task's levels need not be dense)
            level -= 1 if level > self._lowest(task) else -1
        return task, level

    def _draw(self, state: DrawState) -> int:
        """The next slot's problem (a row index), advancing ``state``."""
        task = self.tasks[state.draws % len(self.tasks)]
        pool = self._pool_of(task, state)
        members = self.pools[pool]
        key = f"{pool[0]}/{pool[1]}"
        epoch, offset = state.cursors.get(key, [0, 0])
        order = self.pool_order(pool, epoch)
        for scanned in range(len(members) + 1):
            if offset >= len(members):
                epoch, offset = epoch + 1, 0
                order = self.pool_order(pool, epoch)
            index = members[int(order[offset])]
            offset += 1
            # A pool with nothing left inside the band is drawn from as it is.
            if self.in_band(index) or scanned == len(members):
                break
            state.skipped += 1
        state.cursors[key] = [epoch, offset]
        state.draws += 1
        return index

    def upcoming(self, count: int) -> list[int]:
        """The next ``count`` problems the draws would give, without drawing them."""
        state = self.state.copy()
        return [self._draw(state) for _ in range(count)]

    @property
    def epoch(self) -> int:
        return self.state.draws // max(1, self.num_rollout_per_epoch * self.prompts_per_rollout)

    def next_prompts(self) -> list[PromptRow]:
        return [self.rows[self._draw(self.state)] for _ in range(self.prompts_per_rollout)]

    def peek_groups(self) -> Iterator[list[Sample]]:
        """Groups in the order the draws would give them (at most one per row), without advancing."""
        state = self.state.copy()
        for k in range(len(self.rows)):
            yield self.group(self.rows[self._draw(state)], k)

    def advance(self, groups: int) -> None:
        if groups < 0:
            raise ValueError(f"cannot advance {groups} prompts")
        for _ in range(groups):
            self._draw(self.state)

    # ------------------------------------------------------------ what was measured
    def record(self, index: int, passes: float, samples: int) -> None:
        """Add a measurement of problem ``index``: ``passes`` of ``samples`` passed."""
        had_passes, had_samples = self.rates.get(index, (0.0, 0))
        self.rates[index] = (had_passes + passes, had_samples + samples)

    def start_at(self, levels: dict[str, int]) -> None:
        """Set tasks' levels (the probe's starting levels), before the first draw."""
        for task, level in levels.items():
            if task in self.state.levels and level != self.state.levels[task]:
                self.changes.append(f"{task or 'data'} starts at level {level}")
                self.state.levels[task] = level

    def observe(self, groups: list[list[Sample]], passed: list[list[float]]) -> None:
        """After a rollout: each trained group's passes (``passed``: per sample, 0 to 1) update its
        problem's rate (data.difficulty.update) and its task's recent ones; levels move."""
        for group, passes in zip(groups, passed):
            if not group or not passes:
                continue
            row = self.rows[group[0].prompt_index]
            if self.cfg.update:
                self.record(row.index, float(sum(passes)), len(passes))
            task = row_task(row)
            if task in self.recent and (row_level(row) == self.state.levels[task] or self.cfg.curriculum is None):
                self.recent[task].append(sum(passes) / len(passes))
        if self.cfg.curriculum is not None:
            for task in self.tasks:
                self._move(task)

    def _move(self, task: str) -> None:
        c = self.cfg.curriculum
        assert c is not None
        recent = self.recent[task]
        if len(recent) < c.window:
            return
        mean = statistics.fmean(recent[-c.window:])
        level = self.state.levels[task]
        if mean >= c.raise_at and level < self.top[task]:
            self.state.levels[task] = level + 1
        elif c.lower_at is not None and mean <= c.lower_at and level > self._lowest(task):
            self.state.levels[task] = level - 1
        else:
            return
        self.recent[task] = []
        self.changes.append(f"{task or 'data'}: level {level} -> {self.state.levels[task]} "
                            f"(pass rate {mean:.2f} over its last {c.window} groups)")

    def metrics(self) -> tuple[dict[str, float], list[str]]:
        """Per task: its level and recent pass rate; problems skipped as outside the band; and the level
        changes since the last call (as texts)."""
        out: dict[str, float] = {"data/skipped_out_of_band": float(self.state.skipped)}
        for task in self.tasks:
            name = task or "data"
            if self.cfg.curriculum is not None:
                out[f"data/level/{name}"] = float(self.state.levels[task])
            if self.recent[task]:
                out[f"data/recent_pass/{name}"] = statistics.fmean(self.recent[task][-8:])
        changes, self.changes = self.changes, []
        return out, changes

    def summary(self) -> list[dict]:
        """Per task and level: problems, how many were measured, their mean pass rate, how many sit inside
        the band now, and the task's current level."""
        out = []
        for (task, level), members in sorted(self.pools.items()):
            measured = [self.rates[i] for i in members if i in self.rates and self.rates[i][1]]
            rates = [p / n for p, n in measured]
            out.append({"task": task, "level": level, "problems": len(members), "measured": len(measured),
                        "pass_rate": statistics.fmean(rates) if rates else None,
                        "never": sum(r == 0 for r in rates), "always": sum(r == 1 for r in rates),
                        "in_band": sum(self.in_band(i) for i in members),
                        "current": self.state.levels.get(task) == level if self.cfg.curriculum else None})
        return out

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        s = self.state
        return {"seed": self.seed, "num_rows": len(self.rows), "draws": s.draws, "cursors": s.cursors,
                "levels": s.levels, "skipped": s.skipped, "recent": self.recent,
                "rates": {str(i): list(r) for i, r in self.rates.items()},
                # DataSource's keys, so that tools reading a checkpoint's position still find them
                "epoch": self.epoch, "offset": 0}

    def load_state_dict(self, state: dict) -> None:
        if "draws" not in state:
            raise ValueError("the checkpoint's data position was saved without data.difficulty (a plain data "
                             "source): it cannot be resumed with data.difficulty set")
        for key, have in (("num_rows", len(self.rows)), ("seed", self.seed)):
            if state[key] != have:
                raise ValueError(f"data source state was saved with {key}={state[key]} but the data now has "
                                 f"{have}; refusing to resume")
        self.state = DrawState(int(state["draws"]), {k: list(v) for k, v in state["cursors"].items()},
                               {k: int(v) for k, v in state["levels"].items()}, int(state["skipped"]))
        self.recent = {task: list(state["recent"].get(task, [])) for task in self.tasks}
        self.rates = {int(i): (float(p), int(n)) for i, (p, n) in state["rates"].items()}
