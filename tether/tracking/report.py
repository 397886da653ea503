"""`tether report RUN_DIR`: what a finished (or running) run did to its eval scores.

For every eval set: the score at the first eval (the starting policy, before RL), at the last, the
best and where, the constant-answer baseline (what always giving one answer would score) and the
share of the most common answer; then the run's warnings and its curves (drawn if missing).
"""

from __future__ import annotations

import json
from pathlib import Path

from tether.tracking import plot_curves, read_metrics


def _points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in rows if row.get(key) is not None]


def eval_report(rows: list[dict]) -> list[dict]:
    """One dict per eval set: name, before/after with their steps, best, baseline, top-answer share."""
    names = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("eval/") and k.endswith("/score")})
    out = []
    for name in names:
        scores = _points(rows, f"eval/{name}/score")
        (first_step, before), (last_step, after) = scores[0], scores[-1]
        best_score, best_step = max(((s, -step) for step, s in scores))
        constant = _points(rows, f"eval/{name}/constant_answer_score")
        share = _points(rows, f"eval/{name}/top_answer_share")
        out.append({"name": name, "before": before, "before_step": first_step, "after": after,
                    "after_step": last_step, "best": best_score, "best_step": -best_step,
                    "constant_answer": constant[-1][1] if constant else None,
                    "top_answer_share": share[-1][1] if share else None})
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_report(run_dir: Path, evals: list[dict], warnings: list[dict], curves: Path | None) -> str:
    lines = [f"=== {run_dir}: eval before -> after ==="]
    for e in evals:
        lines.append(f"  {e['name']}: {_pct(e['before'])} (step {e['before_step']}) -> {_pct(e['after'])} "
                     f"(step {e['after_step']}), {100 * (e['after'] - e['before']):+.1f} points; best "
                     f"{_pct(e['best'])} at step {e['best_step']}; constant answer {_pct(e['constant_answer'])}, "
                     f"top answer share {_pct(e['top_answer_share'])}")
    if warnings:
        lines.append(f"  {len(warnings)} warning(s), the first: {warnings[0]['message'].splitlines()[0]}")
    if curves is not None:
        lines.append(f"  curves: {curves}")
    return "\n".join(lines)


def report(run_dir: str | Path) -> dict:
    """Print the report of the run in ``run_dir``; returns it. FileNotFoundError without metrics."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is it a run's output_dir?)")
    evals = eval_report(read_metrics(metrics))
    summary = run_dir / "summary.json"
    warnings = json.loads(summary.read_text()).get("warnings", []) if summary.is_file() else []
    curves = run_dir / "curves.png"
    if not curves.is_file():
        curves = plot_curves(metrics, curves)
    print(format_report(run_dir, evals, warnings, curves) if evals else f"{run_dir}: no eval scores in {metrics}")
    return {"evals": evals, "warnings": warnings, "curves": str(curves)}
