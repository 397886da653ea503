"""Builds everything the arithmetic recipe needs, offline: data, tokenizer, a small Qwen2 model.

The task: two-digit addition ("37+48=" -> "85"). The supervised data comes from a sloppy teacher
that forgets to carry most of the time ("37+48=" -> "75"), the way a cheap labeller or a weaker
model would. SFT imitates it faithfully, carrying mistakes included; RL with a verifiable reward
(exact match against the true sum) then teaches the model to carry. The eval set is held out from
both.

    python recipes/arithmetic/prepare.py --out runs/arithmetic
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tether.models.tiny import build_char_tokenizer, build_tiny_model


def add_without_carry(a: int, b: int) -> int:
    """Digit-wise sum mod 10: what you write if you never carry."""
    out, scale = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * scale
        a, b, scale = a // 10, b // 10, scale * 10
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_data(out: Path, seed: int, sloppiness: float, num_sft: int, num_eval: int) -> dict[str, int]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    eval_pairs, train_pairs = pairs[:num_eval], pairs[num_eval:]
    prompt = "{}+{}=".format
    write_jsonl(out / "eval.jsonl", [{"prompt": prompt(a, b), "label": str(a + b)} for a, b in eval_pairs])
    write_jsonl(out / "train.jsonl", [{"prompt": prompt(a, b), "label": str(a + b)} for a, b in train_pairs])
    sft_rows = []
    for a, b in rng.choices(train_pairs, k=num_sft):
        answer = add_without_carry(a, b) if rng.random() < sloppiness else a + b
        sft_rows.append({"prompt": prompt(a, b), "response": str(answer)})
    write_jsonl(out / "sft.jsonl", sft_rows)
    return {"train": len(train_pairs), "eval": len(eval_pairs), "sft": len(sft_rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/arithmetic", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sloppiness", type=float, default=0.7, help="how often the SFT teacher forgets carries")
    parser.add_argument("--num-sft", type=int, default=16000)
    parser.add_argument("--num-eval", type=int, default=200)
    args = parser.parse_args()
    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    counts = make_data(out / "data", args.seed, args.sloppiness, args.num_sft, args.num_eval)
    tokenizer = build_char_tokenizer(chat_template=False)
    build_tiny_model(out / "base", tokenizer, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=384, max_positions=32, seed=args.seed)
    print(f"[prepare] data {counts} and base model in {out}")


if __name__ == "__main__":
    main()
