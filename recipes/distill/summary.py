"""Both students' eval curves against wall-clock time: `python recipes/distill/summary.py RUN_DIR...`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def curve(run: Path) -> list[tuple[int, float, float]]:
    """(rollout, minutes since the run's first row, eval accuracy) at every eval."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    start = rows[0]["time"] - rows[0].get("timing/eval_s", 0.0)
    return [(r["step"], (r["time"] - start) / 60, r["eval/add2/score"]) for r in rows if "eval/add2/score" in r]


def main() -> None:
    for run in map(Path, sys.argv[1:]):
        points = curve(run)
        print(f"{run.name}: " + "  ".join(f"@{step} {minutes:.1f} min {100 * acc:.1f}%" for step, minutes, acc in points))
        (_, _, first), (_, minutes, last) = points[0], points[-1]
        print(f"  {100 * first:.1f}% -> {100 * last:.1f}% ({100 * (last - first):+.1f} points) in {minutes:.1f} min")


if __name__ == "__main__":
    main()
