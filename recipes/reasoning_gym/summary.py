"""Per-task eval of a reasoning_gym run, before and after RL, with the baselines that tell skill from format.

    python recipes/reasoning_gym/summary.py RUN_DIR

For each eval set (one per task, greedy, held-out problems), from the run's metrics and its eval dumps:

    eval chain_sum: 22.0% -> 46.0% (+24.0)   constant answer 6.0% | well-formed 64% -> 98% | right when well-formed 34% -> 47%

- constant answer: the best score of always giving one answer (the eval set's most common answer);
- well-formed: the share of replies from which an answer of the task's kind could be taken (a number
  for a numeric task), by the reward's own extraction rules. Learning to state an answer is format;
- right when well-formed: accuracy among those replies. When it rises too, the model got better at
  the task, not only at saying an answer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tether.rewards.reasoning_gym import NUMBER, extract_answer, is_number  # noqa: E402


def well_formed(row: dict) -> bool:
    oracle = row["metadata"]["entry"].get("answer")
    answer = extract_answer(row.get("response_text") or "", oracle)
    if answer is None or not answer.strip():
        return False
    return bool(NUMBER.fullmatch(answer.strip())) if is_number(oracle) else True


def dump_stats(path: Path) -> tuple[float, float]:
    """(well-formed share, accuracy among well-formed) of one eval dump."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    formed = [r for r in rows if well_formed(r)]
    right = sum(r["reward"] >= 1.0 for r in formed)
    return len(formed) / max(1, len(rows)), right / max(1, len(formed))


def main(run_dir: str) -> None:
    run = Path(run_dir)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if any(k.startswith("eval/") and k.endswith("/score") for k in r)]
    if len(evals) < 2:
        raise SystemExit(f"{run}: needs an eval before and after training (found {len(evals)})")
    first, last = evals[0], evals[-1]
    tasks = sorted(k.split("/")[1] for k in first if k.startswith("eval/") and k.endswith("/score"))
    gains = []
    for task in tasks:
        before, after = first[f"eval/{task}/score"], last[f"eval/{task}/score"]
        gains.append((before, after))
        constant = last.get(f"eval/{task}/constant_answer_score", float("nan"))
        f0, r0 = dump_stats(run / "rollouts" / f"eval_{task}_{first['step']:06d}.jsonl")
        f1, r1 = dump_stats(run / "rollouts" / f"eval_{task}_{last['step']:06d}.jsonl")
        print(f"eval {task}: {100 * before:.1f}% -> {100 * after:.1f}% ({100 * (after - before):+.1f})   "
              f"constant answer {100 * constant:.1f}% | well-formed {100 * f0:.0f}% -> {100 * f1:.0f}% | "
              f"right when well-formed {100 * r0:.0f}% -> {100 * r1:.0f}%")
    b = sum(x for x, _ in gains) / len(gains)
    a = sum(y for _, y in gains) / len(gains)
    print(f"mean over {len(tasks)} tasks: {100 * b:.1f}% -> {100 * a:.1f}% ({100 * (a - b):+.1f} points), "
          f"step {first['step']} -> {last['step']}")
    difficulty(run, rows)


def difficulty(run: Path, rows: list[dict]) -> None:
    """What data.difficulty kept, per task and level, with the pass rates measured (difficulty/summary.json,
    as of the last checkpoint), and each task's level over the run."""
    path = run / "difficulty" / "summary.json"
    if not path.is_file():
        return
    print("data.difficulty (pass rates: the probe's before the run, then the trained groups'):")
    for row in json.loads(path.read_text()):
        rate = f"pass rate {100 * row['pass_rate']:.0f}% over {row['measured']}" if row["measured"] else "not measured"
        current = " <- level at the end" if row.get("current") else ""
        print(f"  {row['task'] or 'data'} level {row['level']}: {row['in_band']} of {row['problems']} problems in "
              f"the band, {rate} ({row['never']} never solved, {row['always']} always){current}")
    levels = sorted({k for r in rows for k in r if k.startswith("data/level/")})
    for key in levels:
        path_ = [int(r[key]) for r in rows if key in r]
        changes = [f"{lv}" for i, lv in enumerate(path_) if i == 0 or lv != path_[i - 1]]
        print(f"  {key.removeprefix('data/level/')}: levels {' -> '.join(changes)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
