"""Builds what recipes/scale/qwen05b.yaml needs, offline: a random model of Qwen2.5-0.5B's shape and a prompt set.

    python recipes/scale/prepare.py --out runs/scale                  # 0.5b: 358M parameters (99-token vocab)
    python recipes/scale/prepare.py --out runs/scale --vocab 151936   # Qwen2.5's vocab size: 494M parameters
    python recipes/scale/prepare.py --out runs/scale --size 20m       # a smaller rung of bench/scale.py

The model and prompts are bench/scale.py's (the same shapes and builder): <out>/model, an HF directory
(float32 safetensors, the character tokenizer) and <out>/data/train.jsonl, 256 "a+b=" prompts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.scale import SHAPES, build_model, count_params, write_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/scale", help="output directory")
    parser.add_argument("--size", default="0.5b", choices=list(SHAPES))
    parser.add_argument("--vocab", type=int, default=None, help="pad the vocabulary to this size (default: 99)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    data = write_prompts(out / "data" / "train.jsonl", seed=args.seed)
    model = build_model(out / "model", args.size, args.vocab, args.seed)
    print(f"[prepare] {args.size}: {count_params(model) / 1e6:.1f}M parameters in {model}, prompts in {data}")


if __name__ == "__main__":
    main()
