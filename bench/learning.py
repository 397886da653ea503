"""Does RL help a new task? SFT on a sloppy teacher, then GRPO with the defaults, per task and model size.

    python bench/learning.py                                  # all four tasks, the tiny model
    python bench/learning.py --sizes tiny,4m --tasks reverse,max
    python bench/learning.py --grpo train.lr=5e-4 --tag lr5e-4 --reuse-sft   # one GRPO knob changed
    python bench/learning.py --sft sft.num_epoch=2 --tag sft2    # the SFT budget
    python bench/learning.py --show                              # the table of every run so far

Prints, per run: the eval accuracy of the SFT model (GRPO's step 0), after GRPO, the best, the
constant-answer baseline (the best score of always giving one answer), the share of the most
common answer, the warnings raised, and the wall time of SFT and GRPO. Runs go to
runs/suite/<size>/<task>[-<tag>]/; results are appended to runs/suite/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "recipes" / "suite"
sys.path.insert(0, str(SUITE))

from tasks import TASKS  # noqa: E402


def run(args: list[str], log: Path) -> float:
    start = time.perf_counter()
    with open(log, "a") as f:
        subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=f, stderr=subprocess.STDOUT)
    return time.perf_counter() - start


def one(task: str, size: str, out_root: Path, tag: str, sft_overrides: list[str], grpo_overrides: list[str],
        reuse_sft: bool = False) -> dict:
    base = out_root / size / task
    run_dir = base.with_name(f"{task}-{tag}") if tag else base
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "log.txt"
    if not (base / "base" / "config.json").is_file():
        run([str(SUITE / "prepare.py"), "--task", task, "--size", size, "--out", str(base)], log)
    data = base / "data"
    sft_dir, sft_s = run_dir / "sft", 0.0
    if reuse_sft and (base / "sft" / "hf" / "config.json").is_file():
        sft_dir = base / "sft"  # a GRPO knob: start from the defaults' SFT model
    else:
        sft_s = run(["-m", "tether.cli", "sft", "--config", str(SUITE / "sft.yaml"), "--overwrite",
                     f"output_dir={sft_dir}", f"model.path={base}/base", f"sft.path={data}/sft.jsonl",
                     *sft_overrides], log)
    grpo_s = run(["-m", "tether.cli", "train", "--config", str(SUITE / "grpo.yaml"), "--overwrite",
                  f"output_dir={run_dir}/grpo", f"model.path={sft_dir}/hf", f"data.path={data}/train.jsonl",
                  f"eval.datasets.0.path={data}/eval.jsonl",
                  *grpo_overrides], log)
    rows = [json.loads(line) for line in (run_dir / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("eval/task/score") is not None]
    summary = json.loads((run_dir / "grpo" / "summary.json").read_text())
    return {"task": task, "size": size, "tag": tag, "sft": sft_overrides, "grpo": grpo_overrides,
            "before": evals[0]["eval/task/score"], "after": evals[-1]["eval/task/score"],
            "best": max(r["eval/task/score"] for r in evals),
            "constant": evals[-1]["eval/task/constant_answer_score"],
            "top_share": evals[-1]["eval/task/top_answer_share"],
            "warnings": len(summary.get("warnings", [])), "sft_s": sft_s, "grpo_s": grpo_s}


def table(results: list[dict]) -> str:
    head = (f"| task | size | run | SFT (before) | after GRPO | gain | best | constant answer | top answer share "
            f"| warnings | SFT time | GRPO time |\n|{'---|' * 12}")
    lines = [head]
    for r in results:
        sft_time = f"{r['sft_s']:.0f} s" if r["sft_s"] else "reused"
        lines.append(f"| {r['task']} | {r['size']} | {r['tag'] or 'defaults'} | {100 * r['before']:.1f}% | "
                     f"{100 * r['after']:.1f}% | {100 * (r['after'] - r['before']):+.1f} | {100 * r['best']:.1f}% | "
                     f"{100 * r['constant']:.1f}% | {100 * r['top_share']:.1f}% | {r['warnings']} | "
                     f"{sft_time} | {r['grpo_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {sorted(TASKS)}")
    parser.add_argument("--sizes", default="tiny", help="comma-separated, of tiny, 4m")
    parser.add_argument("--out", default=str(ROOT / "runs" / "suite"))
    parser.add_argument("--tag", default="", help="a name for this variant (its runs go to <task>-<tag>)")
    parser.add_argument("--sft", nargs="*", default=[], metavar="section.field=value", help="SFT overrides")
    parser.add_argument("--grpo", nargs="*", default=[], metavar="section.field=value", help="GRPO overrides")
    parser.add_argument("--reuse-sft", action="store_true",
                        help="start GRPO from the defaults' SFT model of each task (for GRPO-only knobs)")
    parser.add_argument("--show", action="store_true", help="print the table of results.jsonl and exit")
    args = parser.parse_args()
    if args.show:
        lines = (Path(args.out) / "results.jsonl").read_text().splitlines()
        print(table([json.loads(line) for line in lines]))
        return
    results = []
    for size in args.sizes.split(","):
        for task in args.tasks.split(","):
            result = one(task, size, Path(args.out), args.tag, args.sft, args.grpo, args.reuse_sft)
            results.append(result)
            with open(Path(args.out) / "results.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")
            print(table([result]).splitlines()[-1], flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
