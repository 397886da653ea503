"""Learning with failures injected: the calculator recipe's GRPO clean, and with 10% of its tool, reward and
environment calls failing (TETHER_INJECT_FAULTS), against a second clean run for the noise.

    python bench/faults.py                 # three runs of 40 rollouts from the recipe's SFT model (~6 min)
    python bench/faults.py --rate 0.2      # another share of failing calls
    python bench/faults.py --show          # the table of the last runs, without running

Runs (each `tether train --config recipes/calculator/grpo.yaml`, from runs/calculator/sft/hf; the SFT
model, the data and the tokenizer are built first when missing):

    clean          seed 0
    clean-seed1    seed 1: how far two clean runs differ (the noise)
    faults         seed 0 with TETHER_INJECT_FAULTS=tool=<rate>,reward=<rate>,environment=<rate>,seed=0:
                   every calculator call and every reward call fails with that chance, each decided
                   per sample, attempt and call (tether/run/faults.py); rollout.failures as the
                   recipe leaves it (3 attempts, masked after, 10% budget)

Prints the eval accuracy (greedy, 200 held-out products) at every eval, the failed samples and
retries summed over the run, the mean share of each batch trained on, and the wall time.
Runs go to runs/faults_cmp/<run>/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "faults_cmp"
CONFIG = ROOT / "recipes" / "calculator" / "grpo.yaml"
SFT_MODEL = ROOT / "runs" / "calculator" / "sft" / "hf"
EVAL = "eval/calc/score"
RUNS = ("clean", "clean-seed1", "faults")


def tether(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "tether.cli", *args], cwd=ROOT, check=True, env=env)


def prepare() -> None:
    """The recipe's data, tokenizer, base and SFT model, when they are not there yet."""
    if SFT_MODEL.is_dir():
        return
    subprocess.run([sys.executable, "recipes/calculator/prepare.py", "--out", "runs/calculator"], cwd=ROOT, check=True)
    tether("sft", "--config", "recipes/calculator/sft.yaml", "--overwrite")


def run(name: str, rollouts: int, rate: float) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TETHER_INJECT_FAULTS"}
    seed = 1 if name == "clean-seed1" else 0
    if name == "faults":
        env["TETHER_INJECT_FAULTS"] = f"tool={rate},reward={rate},environment={rate},seed=0"
    print(f"[faults] {name}: seed {seed}, {env.get('TETHER_INJECT_FAULTS', 'no faults injected')}", flush=True)
    tether("train", "--config", str(CONFIG), "--overwrite", f"output_dir={OUT / name}", f"seed={seed}",
           f"rollout.num_rollout={rollouts}", "checkpoint.save_interval=null", env=env)


def summarize(name: str) -> dict | None:
    path = OUT / name / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r["step"] >= 1]
    total = lambda prefix: sum(v for r in steps for k, v in r.items() if k.startswith(prefix))  # noqa: E731
    return {"run": name, "evals": [(r["step"], r[EVAL]) for r in rows if EVAL in r],
            "failed": sum(r.get("failures/samples", 0.0) for r in steps), "retried": total("failures/retried/"),
            "samples": sum(r["rollout/samples"] for r in steps),
            "trained_frac": sum(r.get("rollout/trained_frac", 1.0) for r in steps) / max(1, len(steps)),
            "wall_s": steps[-1]["time"] - rows[0]["time"] if steps else float("nan")}


def table(results: list[dict]) -> str:
    steps = [s for s, _ in results[0]["evals"]]
    head = "| run | " + " | ".join(f"eval @ {s}" for s in steps) + " | failed samples | retries | trained share | wall (s) |"
    lines = [head, "|" + "---|" * (len(steps) + 5)]
    for r in results:
        scores = dict(r["evals"])
        lines.append(f"| {r['run']} | " + " | ".join(f"{scores[s]:.1%}" if s in scores else "-" for s in steps)
                     + f" | {r['failed']:.0f} of {r['samples']:.0f} | {r['retried']:.0f} | {r['trained_frac']:.1%} | "
                     f"{r['wall_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--rate", type=float, default=0.1, help="share of tool, reward and environment calls failing")
    parser.add_argument("--only", default=",".join(RUNS), help="comma-separated runs")
    parser.add_argument("--show", action="store_true", help="print the table of the last runs only")
    args = parser.parse_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    if not args.show:
        prepare()
        for name in names:
            run(name, args.rollouts, args.rate)
    results = [r for r in (summarize(n) for n in names) if r is not None]
    print(table(results))


if __name__ == "__main__":
    main()
