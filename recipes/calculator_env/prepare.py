"""Builds the calculator_env recipe, offline: data, a character tokenizer with a chat template, a small model.

The calculator recipe's task (a 3-digit times 2-digit product, beyond a 0.4M-parameter model's head)
as a chat with a tool: the model may answer, or write ``<calc>347*58</calc>`` to call the
environment's ``calculate`` tool (env.py, a TRL environment class), whose answer comes back as a
``tool`` message before the model's next turn:

    user: 347*58=<eos>assistant: <calc>347*58</calc><eos>tool: 20126<eos>assistant: 20126<eos>

The chat template (CHAT_TEMPLATE) ends every message with the end-of-turn token <eos>, as real chat
templates do (ChatML's <|im_end|>), so a turn ends where the model ends it. The supervised data is a
sloppy teacher's conversations, as in the calculator recipe: 60% answer with a lazy estimate, 25% call
the tool with the second operand's last digit dropped, 15% call it right. SFT trains on the assistant
turns only (the tool's messages are input).

    python recipes/calculator_env/prepare.py --out runs/calculator_env
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tether.models.tiny import build_char_tokenizer, build_tiny_model
from tether.tools.calculator import evaluate, format_number

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}<eos>"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
TEACHER_MIX = {"skip": 0.60, "misuse": 0.25, "right": 0.15}


def conversation(a: int, b: int, kind: str) -> list[dict]:
    """The teacher's chat for one product."""
    user = {"role": "user", "content": f"{a}*{b}="}
    if kind == "skip":  # the leading digits multiplied, padded with zeros: 347*58 -> 300*50
        return [user, {"role": "assistant", "content": str((a // 100 * 100) * (b // 10 * 10))}]
    expression = f"{a}*{b // 10}" if kind == "misuse" else f"{a}*{b}"
    result = format_number(evaluate(expression))
    return [user, {"role": "assistant", "content": f"<calc>{expression}</calc>"},
            {"role": "tool", "content": result}, {"role": "assistant", "content": result}]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_data(out: Path, seed: int, num_train: int, num_sft: int, num_eval: int) -> dict[str, int]:
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], num_eval + num_train)
    eval_pairs, train_pairs = pairs[:num_eval], pairs[num_eval:]
    write_jsonl(out / "eval.jsonl", [{"prompt": f"{a}*{b}=", "label": str(a * b)} for a, b in eval_pairs])
    write_jsonl(out / "train.jsonl", [{"prompt": f"{a}*{b}=", "label": str(a * b)} for a, b in train_pairs])
    kinds, weights = list(TEACHER_MIX), list(TEACHER_MIX.values())
    rows = [{"messages": conversation(a, b, rng.choices(kinds, weights)[0])}
            for a, b in rng.choices(train_pairs, k=num_sft)]
    write_jsonl(out / "sft.jsonl", rows)
    return {"train": len(train_pairs), "eval": len(eval_pairs), "sft": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/calculator_env", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=20000)
    parser.add_argument("--num-sft", type=int, default=16000)
    parser.add_argument("--num-eval", type=int, default=200)
    args = parser.parse_args()
    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    counts = make_data(out / "data", args.seed, args.num_train, args.num_sft, args.num_eval)
    tokenizer = build_char_tokenizer(chat_template=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    # A 22-token prompt and up to 64 response tokens (a call, the tool's message and the answer take about 53).
    build_tiny_model(out / "base", tokenizer, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=384, max_positions=128, seed=args.seed)
    print(f"[prepare] data {counts} and base model in {out}")


if __name__ == "__main__":
    main()
