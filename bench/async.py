"""Synchronous, one-step-off and fully asynchronous training on the quickstart, one run after another.

    python bench/async.py                     # the eight layouts below, 40 rollouts each (~6 min)
    python bench/async.py --rollouts 20 --only sync-colocated,fully-async-k2
    python bench/async.py --show              # the table of the last runs, without running

Every run is `tether train --config recipes/arithmetic/grpo.yaml` (32 prompts x 8 samples per
rollout, so the same number of samples for each) from the quickstart's SFT model, on 1 trainer and
1 engine, with:

    sync-colocated   the default: trainer and engine take turns on the same 2 cores
    sync-split       the engine on its own bundle (cluster.colocate=false), still taking turns
    one-step-off     rollout.schedule.mode=one_step_off: rollout k+1 generates while the trainer trains on k
    fully-async-k1   rollout.schedule.mode=fully_async, max_staleness=1: groups stream across train steps
    fully-async-k2   the same with max_staleness=2
    fully-async-k2-tis   and with algorithm.rollout_correction=token_clip (truncated importance
                     sampling against the engine's log-probs, which are up to 2 versions old)
    sync-dapo        sync-colocated with DAPO's dynamic sampling: groups whose 8 rewards are all
                     equal are dropped (rollout.dynamic_filter=nonzero_reward_std), 48 groups
                     started per 32 kept (rollout.over_sampling_groups=48)
    fully-async-k2-dapo  the same filter and over-sampling in the fully asynchronous stream

Prints, per layout: the wall time of the training loop (after the first weight push and the eval at
step 0, to after the last row), samples trained per second over that time, the median seconds per
rollout, the trainer's and engine's median idle shares, the eval accuracy at step 0 and at the end,
and eval accuracy gained per wall-clock minute ((end - start) / minutes). The ratio column divides
samples/s by the best synchronous layout's. Runs go to runs/async_cmp/<layout>/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "async_cmp"
CONFIG = ROOT / "recipes" / "arithmetic" / "grpo.yaml"
SFT_MODEL = ROOT / "runs" / "arithmetic" / "sft" / "hf"
EVAL = "eval/add2/score"
SYNC = ("sync-colocated", "sync-split")

LAYOUTS = {
    "sync-colocated": [],
    "sync-split": ["cluster.colocate=false"],
    "one-step-off": ["cluster.colocate=false", "rollout.schedule.mode=one_step_off"],
    "fully-async-k1": ["cluster.colocate=false", "rollout.schedule.mode=fully_async", "rollout.schedule.max_staleness=1"],
    "fully-async-k2": ["cluster.colocate=false", "rollout.schedule.mode=fully_async", "rollout.schedule.max_staleness=2"],
    "fully-async-k2-tis": ["cluster.colocate=false", "rollout.schedule.mode=fully_async", "rollout.schedule.max_staleness=2",
                           "algorithm.rollout_correction=token_clip"],
    "sync-dapo": ["rollout.dynamic_filter=nonzero_reward_std", "rollout.over_sampling_groups=48"],
    "fully-async-k2-dapo": ["cluster.colocate=false", "rollout.schedule.mode=fully_async", "rollout.schedule.max_staleness=2",
                            "rollout.dynamic_filter=nonzero_reward_std", "rollout.over_sampling_groups=48"],
}


def tether(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tether.cli", *args], cwd=ROOT, check=True)


def prepare() -> None:
    """The quickstart's data and SFT model, when they are not there yet."""
    if SFT_MODEL.is_dir():
        return
    subprocess.run([sys.executable, "recipes/arithmetic/prepare.py", "--out", "runs/arithmetic"], cwd=ROOT, check=True)
    tether("sft", "--config", "recipes/arithmetic/sft.yaml", "--overwrite")


def run(name: str, rollouts: int, extra: list[str]) -> None:
    out = OUT / name
    print(f"[async] {name}: {' '.join(LAYOUTS[name]) or '(defaults)'}", flush=True)
    tether("train", "--config", str(CONFIG), "--overwrite", f"output_dir={out}", f"rollout.num_rollout={rollouts}",
           "checkpoint.save_interval=null", *LAYOUTS[name], *extra)


def summarize(name: str) -> dict | None:
    path = OUT / name / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    start, steps = rows[0], [r for r in rows if r["step"] >= 1]
    wall = steps[-1]["time"] - start["time"]
    evals = [r for r in rows if EVAL in r]

    def median(key: str) -> float:
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else float("nan")

    first, last = evals[0][EVAL], evals[-1][EVAL]
    return {"layout": name, "rollouts": len(steps), "wall_s": wall,
            "samples_per_s": sum(r["rollout/samples"] for r in steps) / wall,
            "s_per_rollout": median("timing/rollout_s"), "train_idle": median("perf/train_idle_frac"),
            "engine_idle": median("perf/rollout_idle_frac"), "eval_start": first, "eval_end": last,
            "eval_gain_per_min": (last - first) / (wall / 60),
            "staleness_mean": median("async/staleness_mean") if "async/staleness_mean" in steps[-1] else
            statistics.fmean(r.get("async/staleness", 0.0) for r in steps)}


def table(results: list[dict]) -> str:
    sync = [r["samples_per_s"] for r in results if r["layout"] in SYNC]
    best = max(sync) if sync else None
    head = ("| layout | wall (s) | samples/s | vs best sync | s/rollout | trainer idle | engine idle | "
            "staleness | eval start -> end | eval gain / min |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        ratio = f"{r['samples_per_s'] / best:.2f}x" if best else "-"
        lines.append(f"| {r['layout']} | {r['wall_s']:.1f} | {r['samples_per_s']:.0f} | {ratio} | "
                     f"{r['s_per_rollout']:.3f} | {r['train_idle']:.0%} | {r['engine_idle']:.0%} | "
                     f"{r['staleness_mean']:.2f} | {r['eval_start']:.1%} -> {r['eval_end']:.1%} | "
                     f"{r['eval_gain_per_min']:+.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--only", default=",".join(LAYOUTS), help="comma-separated layouts")
    parser.add_argument("--show", action="store_true", help="print the table of the last runs only")
    parser.add_argument("overrides", nargs="*", help="section.field=value for every run")
    args = parser.parse_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    if not args.show:
        prepare()
        for name in names:
            run(name, args.rollouts, args.overrides)
    results = [r for r in (summarize(n) for n in names) if r is not None]
    print(table(results))


if __name__ == "__main__":
    main()
