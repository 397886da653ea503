"""The distillation recipe's student: a smaller random Qwen2 (hidden 64, 2 layers; ~0.1M parameters)
with the arithmetic recipe's character tokenizer, so the quickstart's trained model (0.4M) can teach it.

    python recipes/distill/prepare.py --out runs/distill
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tether.models.tiny import build_char_tokenizer, build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/distill", help="output directory")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    out = Path(args.out) / "student_base"
    build_tiny_model(out, build_char_tokenizer(chat_template=False), hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, intermediate_size=192, max_positions=32, seed=args.seed)
    print(f"[prepare] student base model in {out}")


if __name__ == "__main__":
    main()
