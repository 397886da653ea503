"""Builds everything the calculator recipe needs, offline: data, tokenizer, a small Qwen2 model.

The task: a 3-digit times 2-digit product ("347*58=" -> "20126"), more than a 0.4M-parameter model
can work out in its head. It has a calculator: it may write ``<calc>347*58</calc>``, the rollout
(agent.py) then inserts the tool's answer ``<result>20126</result>``, and the model goes on with its
final answer ``20126`` and eos. It may also answer straight away.

The supervised data comes from a sloppy teacher (SFT never trains on the tool's output: those
segments have ``"train": false``):

- 60% **skips the tool** and writes a lazy estimate: the leading digits multiplied, padded with zeros
  ("347*58=" -> "15000", i.e. 300*50), a plausible-looking wrong answer;
- 25% **misuses it**: drops the last digit of the second operand (``<calc>347*5</calc>``), and then
  faithfully copies the (wrong) result;
- 15% uses it **right**.

SFT imitates this: greedy decoding mostly estimates, and a call mostly drops the digit, so the SFT
model is almost never right. RL with an exact-match reward on the final answer then teaches it to
call the calculator, and to call it with the whole expression. The eval prompts are held out from
both the RL prompts and the SFT rows.

    python recipes/calculator/prepare.py --out runs/calculator
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tether.models.tiny import build_char_tokenizer, build_tiny_model
from tether.tools.calculator import evaluate, format_number

TEACHER_MIX = {"skip": 0.60, "misuse": 0.25, "right": 0.15}
"""How often the teacher answers without the tool, calls it with a typo, calls it right."""


def estimate(a: int, b: int) -> int:
    """The lazy in-head estimate: leading digits multiplied, the rest zeros (347*58 -> 300*50)."""
    return (a // 100 * 100) * (b // 10 * 10)


def call(expression: str) -> list[dict]:
    """A response that calls the calculator once and copies its answer: the segments of an SFT row."""
    result = format_number(evaluate(expression))
    return [{"text": f"<calc>{expression}</calc>"}, {"text": f"<result>{result}</result>", "train": False},
            {"text": result}]


def teacher(a: int, b: int, kind: str) -> str | list[dict]:
    if kind == "skip":
        return str(estimate(a, b))
    if kind == "misuse":  # the second operand's last digit is lost
        return call(f"{a}*{b // 10}")
    return call(f"{a}*{b}")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_data(out: Path, seed: int, num_train: int, num_sft: int, num_eval: int,
              mix: dict[str, float] = TEACHER_MIX) -> dict[str, int]:
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], num_eval + num_train)
    eval_pairs, train_pairs = pairs[:num_eval], pairs[num_eval:]
    prompt = "{}*{}=".format
    write_jsonl(out / "eval.jsonl", [{"prompt": prompt(a, b), "label": str(a * b)} for a, b in eval_pairs])
    write_jsonl(out / "train.jsonl", [{"prompt": prompt(a, b), "label": str(a * b)} for a, b in train_pairs])
    kinds, weights = list(mix), list(mix.values())
    sft_rows = []
    for a, b in rng.choices(train_pairs, k=num_sft):
        kind = rng.choices(kinds, weights)[0]
        sft_rows.append({"prompt": prompt(a, b), "response": teacher(a, b, kind), "kind": kind})
    write_jsonl(out / "sft.jsonl", sft_rows)
    return {"train": len(train_pairs), "eval": len(eval_pairs), "sft": len(sft_rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/calculator", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=20000)
    parser.add_argument("--num-sft", type=int, default=16000)
    parser.add_argument("--num-eval", type=int, default=200)
    args = parser.parse_args()
    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    counts = make_data(out / "data", args.seed, args.num_train, args.num_sft, args.num_eval)
    tokenizer = build_char_tokenizer(chat_template=False)
    # 7 prompt tokens + up to 64 response tokens (a call, its result and the answer take about 47).
    build_tiny_model(out / "base", tokenizer, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=384, max_positions=96, seed=args.seed)
    print(f"[prepare] data {counts} and base model in {out}")


if __name__ == "__main__":
    main()
