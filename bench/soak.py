"""Soak: a long run of the quickstart recipe, watching every process's memory and the run's disk use.

    python bench/soak.py                  # 200 rollouts (~2 min on 2 cores), then the table and plot
    python bench/soak.py --rollouts 60    # shorter
    python bench/soak.py --show           # the table of the last soak, without running

Runs `tether train --config recipes/arithmetic/grpo.yaml` (from the quickstart's SFT model; built
first when missing) with rollout.num_rollout=<n>, a checkpoint every 20 rollouts with the newest
two kept, an eval every 10. Once a second it samples the resident memory (RSS, children included)
of the driver, the rollout manager, the engine(s) and the train actor(s), found by their Ray process
titles, and the bytes under the output directory; the last sample of each rollout is kept.

Growth is the median of the last 20 rollouts' samples over the median of rollouts 40..59 (after
warm-up: imports, the first evals, allocator pools reaching their size, and the two checkpoints kept
from rollout 40 on), per process and for the disk; the soak passes when every one is under 5%. Writes runs/soak/soak.json and
runs/soak/soak.png (memory and disk over rollouts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "soak"
RUN = OUT / "run"
CONFIG = ROOT / "recipes" / "arithmetic" / "grpo.yaml"
SFT_MODEL = ROOT / "runs" / "arithmetic" / "sft" / "hf"
ROLES = {"ray::RolloutManager": "rollout manager", "ray::EngineActor": "engine", "ray::TrainActor": "train actor"}
WARM, WINDOW, LIMIT = 40, 20, 0.05


def ensure_sft_model() -> None:
    if (SFT_MODEL / "config.json").is_file():
        return
    print("[soak] building the quickstart's SFT model first", flush=True)
    subprocess.run([sys.executable, str(ROOT / "recipes/arithmetic/prepare.py"), "--out", str(ROOT / "runs/arithmetic")],
                   check=True, cwd=ROOT)
    subprocess.run([sys.executable, "-m", "tether.cli", "sft", "--config", str(ROOT / "recipes/arithmetic/sft.yaml"),
                    "--overwrite"], check=True, cwd=ROOT)


def rss_with_children(proc: psutil.Process) -> int:
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def tether_processes(driver: psutil.Process) -> dict[str, psutil.Process]:
    """Role name -> process: the driver, and each actor by its Ray process title."""
    found = {"driver": driver}
    counts: dict[str, int] = {}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        for prefix, role in ROLES.items():
            if title.startswith(prefix):
                k = counts.get(role, 0)
                counts[role] = k + 1
                found[f"{role} {k}" if role != "rollout manager" else role] = proc
    return found


LOGS = ("metrics.jsonl", "trained_samples.jsonl", "events.out.tfevents")
"""Append-only logs: a line (or event) per rollout by design, measured apart from the bounded rest."""


def disk_bytes(path: Path) -> tuple[int, int]:
    """(bytes of checkpoints, dumps and exports; bytes of the append-only logs) under ``path``."""
    bounded = logs = 0
    for f in path.rglob("*") if path.exists() else []:
        if f.is_file():
            size = f.stat().st_size
            if f.name.startswith(LOGS):
                logs += size
            else:
                bounded += size
    return bounded, logs


def current_rollout(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return -1
    return json.loads(lines[-1])["step"] if lines else -1


def sample(proc: subprocess.Popen, samples: dict[int, dict], stop: threading.Event) -> None:
    driver = psutil.Process(proc.pid)
    while not stop.wait(1.0):
        step = current_rollout(RUN / "metrics.jsonl")
        if step < 0:
            continue
        # The driver's own memory: the local Ray it started (raylet, GCS, the actors) are its children.
        row = {name: p.memory_info().rss if name == "driver" else rss_with_children(p)
               for name, p in sorted(tether_processes(driver).items())}
        row["disk"], row["logs"] = disk_bytes(RUN)
        samples[step] = row  # the last sample while this rollout was the newest logged


def run(rollouts: int) -> dict:
    ensure_sft_model()
    OUT.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tether.cli", "train", "--config", str(CONFIG), "--overwrite",
           f"output_dir={RUN}", f"model.path={SFT_MODEL}", f"rollout.num_rollout={rollouts}",
           "checkpoint.save_interval=20", "checkpoint.keep_last=2", "eval.interval=10"]
    samples: dict[int, dict] = {}
    stop = threading.Event()
    start = time.time()
    with open(OUT / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        thread = threading.Thread(target=sample, args=(proc, samples, stop), daemon=True)
        thread.start()
        code = proc.wait()
    stop.set()
    thread.join()
    if code != 0:
        sys.exit(f"[soak] tether train exited {code}; see {OUT / 'train.log'}")
    result = {"rollouts": rollouts, "minutes": (time.time() - start) / 60, "samples": {str(k): v for k, v in sorted(samples.items())}}
    (OUT / "soak.json").write_text(json.dumps(result))
    return result


def growth(series: dict[int, int], last: int) -> tuple[float, float, float]:
    warm = [v for k, v in series.items() if WARM <= k < WARM + WINDOW]
    end = [v for k, v in series.items() if k > last - WINDOW]
    before, after = statistics.median(warm), statistics.median(end)
    return before, after, after / before - 1


def table(result: dict) -> bool:
    samples = {int(k): v for k, v in result["samples"].items()}
    last = max(samples)
    names = sorted({n for row in samples.values() for n in row}, key=lambda n: (n in ("disk", "logs"), n))
    print(f"\nsoak: {result['rollouts']} rollouts of recipes/arithmetic/grpo.yaml in {result['minutes']:.1f} min; "
          f"growth = median of rollouts {last - WINDOW + 1}..{last} over median of rollouts {WARM}..{WARM + WINDOW - 1}\n")
    print(f"| {'':<24} | {'after warm-up':>13} | {'at the end':>10} | {'growth':>6} | < 5% |")
    print("|---|---|---|---|---|")
    passed = True
    for name in names:
        series = {k: row[name] for k, row in samples.items() if name in row}
        before, after, g = growth(series, last)
        if name == "logs":  # grows by design: say by how much per rollout, judged by nothing
            per = (series[last] - series[min(series)]) / max(1, last - min(series)) / 1024
            print(f"| {'logs (MB)':<24} | {before / 2**20:>13.2f} | {after / 2**20:>10.2f} | {g:>+6.1%} | "
                  f"append-only, {per:.1f} KB per rollout |")
            continue
        ok = g < LIMIT
        passed &= ok
        unit = "disk, without logs (MB)" if name == "disk" else f"{name} RSS (MB)"
        print(f"| {unit:<24} | {before / 2**20:>13.1f} | {after / 2**20:>10.1f} | {g:>+6.1%} | {'yes' if ok else 'NO'} |")
    print(f"\n{'PASS' if passed else 'FAIL'}: every process's memory and the disk grew less than 5% after warm-up")
    plot(samples, names)
    return passed


def plot(samples: dict[int, dict], names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(samples)
    fig, (mem, disk) = plt.subplots(1, 2, figsize=(12, 4))
    for name in names:
        axis = disk if name == "disk" else mem
        axis.plot(steps, [samples[k].get(name, float("nan")) / 2**20 for k in steps], label=name)
    mem.set(xlabel="rollout", ylabel="RSS (MB)", title="memory per process")
    disk.set(xlabel="rollout", ylabel="MB", title="output directory")
    mem.legend(fontsize=8)
    for axis in (mem, disk):
        axis.axvspan(WARM, WARM + WINDOW, color="grey", alpha=0.15)
    fig.tight_layout()
    fig.savefig(OUT / "soak.png", dpi=100)
    print(f"plot: {OUT / 'soak.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--show", action="store_true", help="the table of the last soak, without running")
    args = parser.parse_args()
    if args.rollouts < WARM + 2 * WINDOW:
        sys.exit(f"--rollouts must be at least {WARM + 2 * WINDOW} (warm-up, then two windows of {WINDOW})")
    result = json.loads((OUT / "soak.json").read_text()) if args.show else run(args.rollouts)
    sys.exit(0 if table(result) else 1)


if __name__ == "__main__":
    main()
