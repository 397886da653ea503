"""Checks of a validated config against the machine, before any process starts: the files a command
needs exist, and user-function files named by path are there. Errors name the field. Generated prompt
data (reasoning_gym: sections) is written here first, so that every later step sees files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tether.config import TetherConfig
from tether.errors import ConfigError
from tether.rollout.hf_rows import is_hub
from tether.rollout.reasoning_gym_files import materialise


def check_inputs(cfg: TetherConfig, command: str) -> None:
    """Fail before any process starts when a file the command needs is missing; names the field.

    First the reasoning_gym: sections are generated into <output_dir>/data/ and ``cfg`` is pointed at
    those files, in place (tether/rollout/reasoning_gym_files.py): this is the one place where a config's
    prompt sources are resolved, before anything reads them.
    """
    materialise(cfg)
    if command in ("train", "rollout", "eval", "sft"):
        write_environment_data(cfg)
    needed: dict[str, str | None] = {"model.path": cfg.model.path}
    if command == "rollout" or command == "train" and cfg.debug.load_rollouts is None:
        needed["data.path"] = cfg.data.path
    if command == "train" and cfg.debug.load_rollouts is not None:
        needed["debug.load_rollouts"] = cfg.debug.load_rollouts
    elif command == "sft":
        needed["sft.path"] = cfg.sft.path
    if command == "eval":
        needed.pop("model.path")  # --model may name another; checked where it is resolved
    needed.update({f"eval.datasets[{i}].path": d.path for i, d in enumerate(cfg.eval.datasets)})
    needed.update({f"served_models.{name}.path": m.path for name, m in cfg.served_models.items() if m.path is not None})
    problems = []
    for field, value in needed.items():
        if value is None:
            problems.append(f"  {field}: required for `tether {command}`")
        elif not is_hub(value) and not Path(value).exists():  # a Hub dataset is resolved when it is read
            problems.append(f"  {field}: {value} does not exist{_resolved_against(value)}")
    specs = {"rollout.reward": cfg.rollout.reward, "algorithm.policy_loss": cfg.algorithm.policy_loss,
             "rollout.group_reward": cfg.rollout.group_reward, "rollout.dynamic_filter": cfg.rollout.dynamic_filter,
             "rollout.reward_post_process": cfg.rollout.reward_post_process,
             **{f"eval.datasets[{i}].reward": d.reward for i, d in enumerate(cfg.eval.datasets)}}
    for field, spec in specs.items():
        target = (spec or "").rpartition(":")[0]
        if target.endswith(".py") and not Path(target).is_file():
            problems.append(f"  {field}: {target} does not exist (a relative path in a config file is resolved "
                            "against the file's folder, one in an override against the working directory)")
    problems += missing_packages(cfg)
    if cfg.model.lora is not None and command in ("train", "sft") and not problems:
        problems += lora_targets(cfg)
    if cfg.teacher is not None and command == "train" and not problems:
        problems += teacher_tokenizer(cfg)
    if problems:
        raise ConfigError(f"invalid config for `tether {command}`:\n" + "\n".join(problems))
    slow = bfloat16_without_units(cfg) if command in ("train", "sft", "eval", "rollout") else None
    if slow:
        print(f"[tether] warning: {slow}", file=sys.stderr)


def bfloat16_without_units(cfg: TetherConfig) -> str | None:
    """A run that computes in bfloat16 on a CPU without bfloat16 matrix units (AVX-512 BF16 or AMX): there
    PyTorch's bfloat16 matmuls fall back to a slow path (1.1 GFLOP/s against 94 in float32, measured on an
    AVX2 AMD EPYC), so the run would crawl. Not an error: the numbers are right, only slow."""
    wants = {f"{name}={value}" for name, value in (("model.dtype", cfg.model.dtype),
                                                  ("train.compute_dtype", cfg.train.compute_dtype))
             if value == "bfloat16"}
    if not wants or cfg.cluster.gpus_per_bundle > 0:
        return None
    import torch  # only here: the config checks above import no torch

    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return (f"{' and '.join(sorted(wants))} on a CPU without bfloat16 matrix units (AVX-512 BF16 or AMX): "
            "bfloat16 matmuls run up to ~80x slower than float32 here; float32 is the fast choice on this machine")


def lora_targets(cfg: TetherConfig) -> list[str]:
    """model.lora.target_modules checked against the model's layers, built on the meta device (no weights
    read; a second or two)."""
    config_file = Path(cfg.model.path) / "config.json"
    if not config_file.is_file():  # a Hub id: checked where the model is loaded
        return []
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tether.models.lora import target_names

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path))
    try:
        target_names(model, cfg.model.lora, cfg.model.path)  # type: ignore[arg-type]
    except ValueError as err:
        return [f"  {err}"]
    return []


def teacher_tokenizer(cfg: TetherConfig) -> list[str]:
    """The teacher scores the policy's token ids: its tokenizer must give every id the same token."""
    assert cfg.teacher is not None
    served = cfg.served_models[cfg.teacher.model]
    if served.path is None or not (Path(served.path) / "config.json").is_file():
        return []  # servers already running: their tokenizer is theirs to match
    from transformers import AutoTokenizer

    mine, theirs = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (cfg.model.path, served.path))
    if mine == theirs:
        return []
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
    return [f"  teacher.model {cfg.teacher.model!r} ({served.path}) has another tokenizer than model.path "
            f"({cfg.model.path}): {len(theirs)} tokens against {len(mine)}, e.g. {differ}; a teacher scores the "
            "policy's token ids, so both must share one vocabulary"]


def _resolved_against(value: str) -> str:
    """Where a relative data or model path was looked for: the working directory (function specs
    resolve against the config file's folder instead, so the two can differ in one YAML)."""
    path = Path(value).expanduser()
    return "" if path.is_absolute() else f" (looked for {path.resolve()}: data and model paths are relative to " \
        "the working directory, function specs to the config file's folder)"


OPTIONAL = {  # field set -> (the module it imports, what installs it)
    "tracking.wandb=true": ("wandb", "pip install 'wandb>=0.17'"),
    "cluster.router=sglang_router": ("sglang_router", "pip install 'sglang-router>=0.3'"),
}


def missing_packages(cfg: TetherConfig) -> list[str]:
    """Optional packages the config asks for and this environment lacks, each with its install command:
    found here, not when the process that imports it starts a minute later."""
    asked = {"tracking.wandb=true": cfg.tracking.wandb, "cluster.router=sglang_router": cfg.cluster.router == "sglang_router"}
    return [f"  {field}: needs the '{module}' package, which is not installed here: {install}"
            for field, (module, install) in OPTIONAL.items() if asked[field] and importlib.util.find_spec(module) is None]


def write_environment_data(cfg: TetherConfig) -> None:
    """An environment that brings its own dataset (verifiers) writes it as prompt JSONL to
    <output_dir>/data/ when data.path is not set, and its eval split as the eval set eval_name asks for."""
    env = cfg.rollout.environment
    if env is None or env.type != "verifiers":
        return
    from tether.config.tree import DataConfig, EvalDatasetConfig
    from tether.envs.verifiers import write_dataset

    folder = Path(cfg.output_dir) / "data"
    if cfg.data.path is None:
        path = write_dataset(env, "train", folder / f"verifiers_{env.env_id}_train.jsonl")
        # Its prompts are chat messages (the environment's chat session renders them in any case).
        cfg.data = DataConfig.model_validate({**cfg.data.model_dump(), "path": str(path), "apply_chat_template": True})
    if env.eval_name and not any(d.name == env.eval_name for d in cfg.eval.datasets):
        path = write_dataset(env, "eval", folder / f"verifiers_{env.env_id}_eval.jsonl")
        extra = EvalDatasetConfig(name=env.eval_name, path=str(path))
        cfg.eval = cfg.eval.model_copy(update={"datasets": [*cfg.eval.datasets, extra]})
