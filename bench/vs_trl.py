"""tether against TRL's GRPOTrainer: the same RL step on the same model, prompts and reward, one after the other.

    python bench/vs_trl.py                        # tiny (0.4M) and 20m (19M), float32 and bfloat16 (~20 min)
    python bench/vs_trl.py --sizes tiny --steps 8 # a quick look

TRL goes into its own virtual environment on first use (bench/.venv-trl: torch==2.13.0 CPU, TRL pinned
below), so tether's environment is untouched. Per model size: the suite's `reverse` task
(recipes/suite: "rev:abcde=" -> "edcba"), a random Qwen2 warmed up by a short `tether sft` on the
sloppy teacher (so both start from the same model with rewards between 0 and 1), then GRPO with:

    32 prompts x 8 samples, up to 14 new tokens, temperature 1, float32 weights, exact-match reward,
    one optimizer step per batch, AdamW lr 1e-5 constant, clip 0.2 / 0.28, token-mean loss over the
    batch (TRL's "dapo"), group-normalised advantages, no KL term (no reference model), grad clip 1.

Each size runs twice: computing in float32, and in bfloat16 with float32 weights (mixed precision:
tether's train.compute_dtype, TRL's bf16=True through accelerate's autocast).

Prints, per size and compute dtype: seconds per step (median / min / max after --skip warm-up steps) of each, the ratio
tether / TRL, the start-up of each (process start to the first step), and the mean reward per step.

What differs, by design of each framework: tether generates in its engine process (continuous
batching; each sequence stops at its EOS) and pushes the new weights into it after every step (in
the step time); TRL generates with HF `generate` in the training process (padded batch, runs until
every sequence has stopped) and needs no weight push. tether's step time also includes Ray calls
and moving the batch through the object store. tether sends the 32 groups to its engine in 4
requests of 8 (rollout.groups_per_request: 8; the default, one request per group, gives the same
tokens and costs ~0.07 s more per step on the tiny model). Advantages: TRL divides by the unbiased group std
+ 1e-4, tether by the population std + 1e-6. The prompts are drawn in each framework's own
shuffled order, so the reward curves are comparable in trend, not step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "recipes" / "suite"
TRL_VERSION = "1.16.0"
# Epochs over the suite's 16000 sloppy-teacher answers: enough that the SFT model answers in the
# task's format and gets some right (a start where every reward is 0 gives no gradient to compare).
SFT_EPOCHS = {"tiny": 5, "4m": 2, "20m": 1}


def trl_python() -> Path:
    """A separate virtual environment with TRL and torch's CPU build (created on first use)."""
    venv = ROOT / "bench" / ".venv-trl"
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        print(f"[vs_trl] installing TRL {TRL_VERSION} into {venv} (first use)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # torch first, pinned: a plain `pip install trl` would pull a multi-GB CUDA build of torch.
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
        (venv / ".installed").touch()
    return python


def run(cmd: list[str], log: Path) -> float:
    start = time.perf_counter()
    with open(log, "a") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); see {log}")
    return time.perf_counter() - start


def prepare(size: str, out: Path, log: Path) -> Path:
    """Data, a random model of the size and a short SFT warm start; reused when already there."""
    sft_hf = out / "sft" / "hf"
    if (sft_hf / "config.json").is_file():
        return sft_hf
    run([sys.executable, str(SUITE / "prepare.py"), "--task", "reverse", "--size", size, "--out", str(out)], log)
    run([sys.executable, "-m", "tether.cli", "sft", "--config", str(SUITE / "sft.yaml"), "--overwrite",
         f"output_dir={out}/sft", f"model.path={out}/base", f"sft.path={out}/data/sft.jsonl",
         f"sft.num_epoch={SFT_EPOCHS.get(size, 1)}", "eval.datasets=[]"], log)
    return sft_hf


def settings(args: argparse.Namespace, model: Path, prompts: Path, compute: str) -> dict:
    return {"model": str(model), "prompts": str(prompts), "steps": args.steps, "bf16": compute == "bfloat16",
            "prompts_per_step": 32,
            "samples_per_prompt": 8, "max_new_tokens": 14, "temperature": 1.0, "lr": 1e-5, "clip_low": 0.2,
            "clip_high": 0.28, "grad_clip": 1.0, "seed": 0, "threads": os.cpu_count() or 1}


def run_tether(s: dict, out: Path, log: Path) -> dict:
    n = s["prompts_per_step"] * s["samples_per_prompt"]
    cfg = {
        "output_dir": str(out), "seed": s["seed"], "model": {"path": s["model"]}, "data": {"path": s["prompts"]},
        "rollout": {"num_rollout": s["steps"], "prompts_per_rollout": s["prompts_per_step"],
                    "n_samples_per_prompt": s["samples_per_prompt"], "max_response_len": s["max_new_tokens"],
                    "temperature": s["temperature"], "reward": "exact_match",
                    # 4 requests of 8 groups instead of 32 of one: the same tokens, less HTTP per step
                    "groups_per_request": 8},
        "algorithm": {"advantage_estimator": "grpo", "policy_loss": "ppo_clip", "eps_clip_low": s["clip_low"],
                      "eps_clip_high": s["clip_high"], "loss_agg_mode": "token_mean", "kl_loss_coef": 0.0},
        "train": {"global_batch_size": n, "micro_batch_size": n, "lr": s["lr"], "grad_clip": s["grad_clip"],
                  **({"compute_dtype": "bfloat16"} if s["bf16"] else {})},
        "eval": {"interval": None, "datasets": []},
        "checkpoint": {"save_interval": None},
        "tracking": {"tensorboard": False},
    }
    config = out.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(cfg))
    wall = run([sys.executable, "-m", "tether.cli", "train", "--config", str(config), "--overwrite"], log)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    return {"seconds": [r["timing/rollout_s"] - r.get("timing/save_s", 0.0) for r in steps],
            "rewards": [r["rollout/reward_mean"] for r in steps],
            "startup_s": next(r["startup/total_s"] for r in rows if "startup/total_s" in r), "wall_s": wall,
            "phases": {k: statistics.median(r[k] for r in steps if k in r)
                       for k in sorted({k for r in steps for k in r if k.startswith("timing/")})}}


def run_trl(s: dict, out: Path, log: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    setup, result = out / "setup.json", out / "result.json"
    setup.write_text(json.dumps({**s, "out_dir": str(out / "trainer")}))
    wall = run([str(trl_python()), str(ROOT / "bench" / "trl_grpo.py"), str(setup), str(result)], log)
    data = json.loads(result.read_text())
    return {"seconds": [r["seconds"] for r in data["steps"]], "rewards": [r.get("reward", float("nan")) for r in data["steps"]],
            "startup_s": data["first_step_at_s"], "wall_s": wall,
            "generate_s": statistics.median(r["generate_s"] for r in data["steps"][1:])}


def stats(seconds: list[float], skip: int) -> tuple[float, float, float]:
    kept = seconds[skip:] or seconds
    return statistics.median(kept), min(kept), max(kept)


def params(model: Path) -> float:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(model / "model.safetensors")).values()) / 1e6


def report(results: list[dict], skip: int) -> str:
    lines = ["| model | params | compute | tether s/step (median, min-max) | TRL s/step (median, min-max) "
             "| tether / TRL | start-up tether / TRL |", "|---|---|---|---|---|---|---|"]
    for r in results:
        t, h = stats(r["tether"]["seconds"], skip), stats(r["trl"]["seconds"], skip)
        lines.append(f"| {r['size']} | {r['params']:.1f}M | {r['compute']} | {t[0]:.3f} ({t[1]:.3f}-{t[2]:.3f}) | "
                     f"{h[0]:.3f} ({h[1]:.3f}-{h[2]:.3f}) | **{t[0] / h[0]:.2f}x** | "
                     f"{r['tether']['startup_s']:.1f} s / {r['trl']['startup_s']:.1f} s |")
    lines.append("")
    for r in results:
        for name in ("tether", "trl"):
            curve = " ".join(f"{x:.2f}" for x in r[name]["rewards"])
            lines.append(f"reward per step, {r['size']} {r['compute']}, {name:>6}: {curve}")
    lines.append("")
    for r in results:
        phases = ", ".join(f"{k.removeprefix('timing/').removesuffix('_s')} {v:.3f}"
                           for k, v in r["tether"]["phases"].items() if k != "timing/rollout_s")
        lines.append(f"tether's step on {r['size']} {r['compute']}, median seconds: {phases}")
        t, h = statistics.median(r["tether"]["seconds"]), statistics.median(r["trl"]["seconds"])
        tg = r["tether"]["phases"]["timing/generate_s"] + r["tether"]["phases"].get("timing/rollout_fn_overhead_s", 0.0)
        lines.append(f"  against TRL's: generate + score {tg:.3f} vs {r['trl']['generate_s']:.3f}, the rest "
                     f"(train, push, calls) {t - tg:.3f} vs {h - r['trl']['generate_s']:.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,20m", help="comma-separated, of tiny, 4m, 20m (recipes/suite/prepare.py)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the step statistics")
    parser.add_argument("--compute", default="float32,bfloat16",
                        help="float32, and/or bfloat16: mixed precision in both (tether's train.compute_dtype, "
                             "TRL's bf16=True), float32 weights")
    parser.add_argument("--out", default="runs/vs_trl")
    args = parser.parse_args()
    trl_python()  # install first, so the timed runs do not wait for it
    results = []
    for size in args.sizes.split(","):
        out = ROOT / args.out / size
        log = out / "log.txt"
        out.mkdir(parents=True, exist_ok=True)
        model = prepare(size, out, log)
        for compute in args.compute.split(","):
            s = settings(args, model, out / "data" / "train.jsonl", compute)
            print(f"[vs_trl] {size} {compute}: tether ...", flush=True)
            tether = run_tether(s, out / f"tether-{compute}", log)
            print(f"[vs_trl] {size} {compute}: TRL ...", flush=True)
            trl = run_trl(s, Path(tempfile.mkdtemp(prefix=f"trl-{compute}-", dir=out)), log)
            results.append({"size": size, "compute": compute, "params": params(model), "tether": tether, "trl": trl})
            (out / f"result-{compute}.json").write_text(json.dumps(results[-1], indent=1))
    print(report(results, args.skip))


if __name__ == "__main__":
    main()
