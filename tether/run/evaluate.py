"""`tether eval`: score a model on a config's eval sets, with the engines and rewards a run uses.

    tether eval --config grpo.yaml --model runs/x/hf            # an HF model directory
    tether eval --config grpo.yaml --model runs/x/checkpoints   # a checkpoint (the latest complete one)

The model is served by the config's engines and each eval set is generated, scored and dumped as in
a training run's eval: scores, the constant-answer baseline and per-answer counts, written under
``<out>`` (eval.json, rollouts/). `tether sft` calls ``run_evals`` on its exported model.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from tether.run.checkpoint import META, find_latest
from tether.cluster import plan_placement
from tether.engine.backends import placed_engines, served_engines
from tether.config import ConfigError, TetherConfig, config_from_dict


def model_dir(source: str, out: Path, field: str = "--model") -> str:
    """An HF directory for ``source``: as is, or exported from a checkpoint (or a root holding some)."""
    path = Path(source)
    if (path / "config.json").is_file():
        return str(path)
    if (path / META).is_file() or find_latest(path) is not None:
        from tether.models.export import export_checkpoint

        return str(export_checkpoint(path, out / "model"))
    if not path.exists():
        from tether.models.source import is_hub_id, resolve_model

        if is_hub_id(source):
            return resolve_model(source, field)
    raise ConfigError(f"{field} {source}: neither an HF model directory (config.json), a checkpoint, "
                      "nor a Hugging Face Hub id")


def scores_table(metrics: dict) -> str:
    names = sorted({k.split("/")[1] for k in metrics if k.startswith("eval/") and k.endswith("/score")})
    lines = [f"{'eval set':<16} {'score':>8} {'constant answer':>16} {'top answer share':>17}"]
    for name in names:
        lines.append(f"{name:<16} {metrics[f'eval/{name}/score']:>8.3f} "
                     f"{metrics.get(f'eval/{name}/constant_answer_score', float('nan')):>16.3f} "
                     f"{metrics.get(f'eval/{name}/top_answer_share', float('nan')):>17.3f}")
    return "\n".join(lines)


def pass_rates_table(metrics: dict, rollouts: Path, step: int = 0) -> str:
    """pass@k of each set sampled more than once, and how many prompts passed 0, 1, ..., n of n times
    (from the per-prompt file written next to the samples)."""
    lines = []
    for path in sorted(rollouts.glob(f"eval_*_{step:06d}_prompts.jsonl")):
        name = path.name[len("eval_"):-len(f"_{step:06d}_prompts.jsonl")]
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        n = max((r["n"] for r in rows), default=1)
        if n < 2:
            continue
        ks = sorted((int(k.rpartition("@")[2]), v) for k, v in metrics.items() if k.startswith(f"eval/{name}/pass@"))
        counts = Counter(r["passed"] for r in rows)
        lines.append(f"{name}: " + "  ".join(f"pass@{k} {v:.3f}" for k, v in ks))
        lines.append(f"  prompts by passes of {n}: " + "  ".join(f"{c}/{n}: {counts.get(c, 0)}" for c in range(n + 1))
                     + f"   (per prompt: {path})")
    return "\n".join(lines)


def run_evals(cfg: TetherConfig, model_path: str, out: Path, step: int = 0) -> dict:
    """Serve ``model_path`` on the config's engines and run every eval set once; returns the metrics
    (with "warnings"). Starts Ray when it is not running; leaves it running for the caller."""
    from tether.rollout.handle import RolloutHandle, create_engines

    raw = cfg.model_dump(mode="json")
    raw["model"]["path"] = model_path
    raw["output_dir"] = str(out)
    cfg = config_from_dict(raw, "eval")
    placement = plan_placement(cfg.cluster, placed_engines(cfg), served_engines(cfg))
    engines = create_engines(cfg, placement)
    rollout = None
    try:
        rollout = RolloutHandle(cfg, engines, placement)
        return rollout.eval(step)
    finally:
        if rollout is not None:
            rollout.shutdown()
        else:
            import ray

            for engine in engines:
                ray.kill(engine)
        placement.remove()


def evaluate(cfg: TetherConfig, model: str | None, out: str | None) -> dict:
    """`tether eval`: the scores of ``model`` (default model.path), printed and written to <out>/eval.json."""
    if not cfg.eval.datasets:
        raise ConfigError("tether eval: the config has no eval.datasets to score")
    out_dir = Path(out or Path(cfg.output_dir) / "eval")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir(model or cfg.model.path, out_dir, "--model" if model else "model.path")
    from tether.models.architectures import check_architecture

    check_architecture(path, "--model" if model else "model.path")
    metrics = run_evals(cfg, path, out_dir)
    warnings = metrics.pop("warnings", [])
    for text in warnings:
        print(f"!! WARNING: {text}", file=sys.stderr)
    print(f"model {path}\n{scores_table(metrics)}\nsamples and per-answer counts: {out_dir / 'rollouts'}")
    passes = pass_rates_table(metrics, out_dir / "rollouts")
    if passes:
        print(passes)
    result = {"model": path, "metrics": metrics, "warnings": warnings}
    (out_dir / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    return result
