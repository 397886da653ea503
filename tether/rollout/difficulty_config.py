"""The data.difficulty section: train where the model has signal (tether/rollout/difficulty.py and
probe.py), beside the data section it belongs to. Imports neither torch nor Ray.

A GRPO group whose samples all score alike (all wrong, all right) has no advantage and teaches nothing,
yet costs a full group's generation. Two tools, each optional:

- the band: the starting model's pass rate of each problem, measured before the run with the run's own
  engines (``probe_samples`` samples each, cached in <output_dir>/difficulty/, resumable), and the
  problems outside ``band`` left out; training rollouts keep the rates current as they go;
- the curriculum: problems tagged with a level (reasoning-gym's per-task difficulty levels,
  data.reasoning_gym.levels) are drawn from each task's current level, which starts where the model has
  signal (measured, or given) and rises as the task's recent rewards do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tether.config.base import Section

Rate = float


class CurriculumConfig(Section):
    start: Literal["probe"] | int = "probe"
    """Each task's first level: probe (the hardest level, going up from 0, whose probed pass rate is at
    least start_pass; a task that stays under it from level 0 starts there) or a level number."""
    start_pass: Rate = Field(0.5, ge=0, le=1)
    """With start: probe, the pass rate a level needs for a task to start at it."""
    probe_problems: int = Field(8, ge=1)
    """With start: probe, problems probed at each level of each task."""
    raise_at: Rate = Field(0.7, gt=0, le=1)
    """A task moves up a level when its mean reward over its last `window` trained groups reaches this."""
    lower_at: Rate | None = Field(None, ge=0, lt=1)
    """A task moves down a level when that mean falls to this or below (None: never down)."""
    window: int = Field(8, ge=1)
    """Trained groups of a task its level decisions look at (the window restarts at each change)."""

    @model_validator(mode="after")
    def _order(self) -> CurriculumConfig:
        if self.lower_at is not None and self.lower_at >= self.raise_at:
            raise ValueError(f"lower_at ({self.lower_at}) must be below raise_at ({self.raise_at})")
        return self


class DifficultyConfig(Section):
    probe_samples: int = Field(4, ge=1)
    """Samples per problem when the starting model's pass rates are measured before the run (with
    rollout's sampling settings and reward)."""
    probe_problems: int | None = Field(None, ge=0)
    """Problems whose pass rate is measured before the run, in the order training will draw them (their
    levels' with a curriculum); None: every problem; 0: none (the band then acts on the rates training
    rollouts measure)."""
    band: tuple[Rate, Rate] = (0.0, 1.0)
    """Train on problems whose measured pass rate p is inside the band, low < p < high: [0, 1] leaves out
    the problems never solved and those always solved. A problem not measured yet is kept."""
    pass_at: float | None = None
    """A sample passes when its reward is at least this; None: a sample counts its reward (clipped to
    [0, 1]) as its share of a pass, so a task that gives partial credit (a reply half right scores 0.5)
    has pass rates between 0 and 1 and a curriculum on it can rise; for 0/1 rewards both are the same."""
    update: bool = True
    """Each trained group updates its problem's pass rate (the band then acts on it when the problem
    comes round again)."""
    curriculum: CurriculumConfig | None = None
    """Draw each task's problems from its current level (rows tagged metadata.level, e.g. by
    data.reasoning_gym.levels); None: no levels."""

    def passed(self, reward: float) -> float:
        """How much of a pass a sample with ``reward`` counts for (pass_at)."""
        if self.pass_at is None:
            return min(1.0, max(0.0, reward))
        return float(reward >= self.pass_at)

    @model_validator(mode="after")
    def _band(self) -> DifficultyConfig:
        low, high = self.band
        if not 0 <= low < high <= 1:
            raise ValueError(f"band: [low, high] with 0 <= low < high <= 1, got {list(self.band)}")
        return self
