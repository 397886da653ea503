"""Prints eval accuracy before RL (the SFT model, step 0) and after the last rollout.

    python recipes/arithmetic/report.py runs/arithmetic/grpo
"""

from __future__ import annotations

import sys
from pathlib import Path

from tether.tracking import read_metrics


def main(run_dir: str) -> int:
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    evals = sorted({k for row in rows for k in row if k.startswith("eval/") and k.endswith("/score")})
    if not evals:
        print(f"no eval scores in {run_dir}/metrics.jsonl", file=sys.stderr)
        return 1
    print("\n=== eval accuracy: SFT model (before RL) -> after GRPO ===")
    for key in evals:
        points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
        (first_step, before), (last_step, after) = points[0], points[-1]
        name = key.split("/")[1]
        print(f"  {name}: {100 * before:.1f}% (step {first_step}) -> {100 * after:.1f}% (step {last_step}), "
              f"{100 * (after - before):+.1f} points")
    print(f"  curves: {Path(run_dir) / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/arithmetic/grpo"))
