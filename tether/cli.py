"""The `tether` command.

    tether train --config recipe.yaml [section.field=value ...] [--load DIR] [--overwrite] [--dry-run]
    tether sft   --config sft.yaml    [section.field=value ...] [--overwrite] [--dry-run]
    tether export CKPT OUT
"""

from __future__ import annotations

import argparse
import sys

from tether.config import ConfigError, TetherConfig, check_inputs, dump_config, load_config
from tether.errors import EngineDiedError, NonFiniteError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tether", description="RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "RL training (rollout -> reward -> train -> weight sync)"),
                       ("sft", "supervised fine-tuning through the same trainer")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--config", "-c", help="YAML recipe")
        p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")
        p.add_argument("--overwrite", action="store_true",
                       help="start afresh even if output_dir holds an earlier run (its logs and checkpoints are deleted)")
        if name == "train":
            p.add_argument("--load", metavar="DIR", help="resume from the latest complete checkpoint in DIR")
    export = sub.add_parser("export", help="write a checkpoint's model as an HF directory",
                            description="write a checkpoint's model as an HF directory (safetensors, config, tokenizer)")
    export.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint root (its latest complete one)")
    export.add_argument("out", help="output directory")
    return parser


def _load(args: argparse.Namespace) -> TetherConfig:
    cfg = load_config(args.config, list(args.overrides))
    if getattr(args, "load", None):
        # Set as is, not parsed as a YAML override: a path may contain '#' or look like a number.
        cfg.checkpoint.load = args.load
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "export":
        from tether.export import export_checkpoint

        print(f"exported to {export_checkpoint(args.checkpoint, args.out)}")
        return 0
    try:
        cfg = _load(args)
    except ConfigError as err:
        print(f"tether: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_config(cfg), end="")
        return 0
    try:
        check_inputs(cfg, args.command)
    except ConfigError as err:
        print(f"tether: {err}", file=sys.stderr)
        return 2
    try:
        if args.command == "train":
            from tether.train import train

            train(cfg, overwrite=args.overwrite, config_path=args.config)
        else:
            from tether.sft import sft

            sft(cfg, overwrite=args.overwrite, config_path=args.config)
    except ConfigError as err:  # e.g. a resume whose config no longer matches the checkpoint
        print(f"tether: {err}", file=sys.stderr)
        return 2
    except (NonFiniteError, EngineDiedError) as err:
        # Failures that explain themselves: their message, not a remote traceback (Ray wraps it in .cause).
        print(f"tether: {getattr(err, 'cause', None) or err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
