"""Builds everything the math-word recipe needs, offline: data, tokenizer, a small Qwen2 model.

The task: short word problems answered with a worked step and a boxed number, GSM8K-style RLVR in
miniature:

    user:      Ann has 7 pens and gives 3 to Ben. How many pens does she have left?
    assistant: 7-3=4. \\boxed{4}

Five kinds of problem: buying more (a+b), giving away (a-b), groups of ("3 boxes with 4 pens
each", a*b), and two two-step ones (buy then give away, a+b-c; groups plus loose ones, a*b+c).
Names, objects, verbs and containers vary; numbers stay small so a character-level model can do
the arithmetic.

The supervised data comes from a sloppy teacher that reads the numbers but not the words: most of
the time it adds whatever it sees, so "gives away" becomes a sum and "3 boxes with 4 pens each"
becomes 3+4. The mistakes are systematic, like those of a cheap labeller or a weaker model, and its
arithmetic is always right. SFT imitates it faithfully, mistakes included, and so starts from a model
that does buying problems well and the rest mostly wrong; RL with the `math` reward (the last
\\boxed{} checked against the true answer) then teaches it to read the operation from the words.
The eval problems are held out from both (no eval problem text occurs in train or SFT data).

    python recipes/math_word/prepare.py --out runs/math_word
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

from tether.models.tiny import build_char_tokenizer, build_tiny_model

# Every character is a token, and every prompt carries this line, so it is kept short.
SYSTEM = "Put the final answer in \\boxed{}."

NAMES = [("Ann", "she"), ("Eve", "she"), ("Ivy", "she"), ("Kim", "she"), ("Liz", "she"), ("Pam", "she"),
         ("Uma", "she"), ("Zoe", "she"), ("Ben", "he"), ("Dan", "he"), ("Gus", "he"), ("Jon", "he"),
         ("Max", "he"), ("Ned", "he"), ("Sam", "he"), ("Tom", "he")]
OBJECTS = ["apples", "pens", "cards", "books", "shells", "coins", "eggs", "stamps", "cups", "balls",
           "kites", "hats", "beads", "nuts"]
CONTAINERS = ["boxes", "bags", "jars", "packs", "bowls"]
GAIN_VERBS = ["buys", "finds", "gets", "wins"]
LOSS_VERBS = ["gives {n} to {other}", "gives away {n}", "loses {n}", "sells {n}"]


def solve(start: int, ops: list[tuple[str, int]]) -> tuple[str, int]:
    """Applies ops to `start` one worked step at a time: the response text and the answer.

    solve(7, [("+", 5)]) -> ("7+5=12. \\boxed{12}", 12)
    """
    parts, value = [], start
    for op, b in ops:
        result = {"+": value + b, "-": value - b, "*": value * b}[op]
        parts.append(f"{value}{op}{b}={result}")
        value = result
    return ". ".join(parts) + f". \\boxed{{{value}}}", value


def make_problem(rng: random.Random, kind: str) -> tuple[str, int, list, list]:
    """(problem text, first number, true ops, the sloppy teacher's ops) of one problem of `kind`."""
    (name, pronoun), (other, _) = rng.sample(NAMES, 2)
    obj, box = rng.choice(OBJECTS), rng.choice(CONTAINERS)
    gain, loss = rng.choice(GAIN_VERBS), rng.choice(LOSS_VERBS)
    if kind == "add":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        text = f"{name} has {a} {obj} and {gain} {b} more. How many {obj} does {pronoun} have now?"
        return text, a, [("+", b)], [("+", b)]
    if kind == "sub":
        a = rng.randint(2, 9)
        b = rng.randint(1, a - 1)
        text = f"{name} has {a} {obj} and {loss.format(n=b, other=other)}. How many {obj} does {pronoun} have left?"
        return text, a, [("-", b)], [("+", b)]
    if kind == "mul":
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        text = f"{name} has {a} {box} with {b} {obj} each. How many {obj} does {pronoun} have?"
        return text, a, [("*", b)], [("+", b)]
    if kind == "add_sub":
        a = rng.randint(1, 8)
        b = rng.randint(1, 9 - a)
        c = rng.randint(1, a + b - 1)
        text = f"{name} has {a} {obj}, {gain} {b} more and {loss.format(n=c, other=other)}. How many are left?"
        return text, a, [("+", b), ("-", c)], [("+", b), ("+", c)]
    if kind == "mul_add":
        a, b = rng.choice([(2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (3, 3)])
        c = rng.randint(1, 9)
        text = f"{name} has {a} {box} with {b} {obj} each and {c} more {obj}. How many {obj} in all?"
        return text, a, [("*", b), ("+", c)], [("+", b), ("+", c)]
    raise ValueError(f"unknown kind {kind!r}")


KINDS = ["add", "sub", "mul", "add_sub", "mul_add"]


def messages(problem: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem}]


def unique_problems(rng: random.Random, count: int) -> list[tuple[str, int, list, list]]:
    """`count` problems with distinct texts, kinds in equal shares (so eval and train are disjoint by text)."""
    seen, out = set(), []
    while len(out) < count:
        problem = make_problem(rng, KINDS[len(out) % len(KINDS)])
        if problem[0] not in seen:
            seen.add(problem[0])
            out.append(problem)
    rng.shuffle(out)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_data(out: Path, seed: int, sloppiness: float, num_train: int, num_sft: int,
              num_eval: int) -> dict[str, object]:
    rng = random.Random(seed)
    problems = unique_problems(rng, num_eval + num_train)
    eval_set, train_set = problems[:num_eval], problems[num_eval:]

    def labelled(rows):
        return [{"prompt": messages(text), "label": str(solve(a, true)[1])} for text, a, true, _ in rows]

    write_jsonl(out / "eval.jsonl", labelled(eval_set))
    write_jsonl(out / "train.jsonl", labelled(train_set))
    sft_rows = []
    for text, a, true, sloppy in rng.choices(train_set, k=num_sft):
        # On buying problems "add everything" is the right operation, so the teacher is right there anyway.
        ops = sloppy if rng.random() < sloppiness else true
        sft_rows.append({"prompt": messages(text), "response": solve(a, ops)[0]})
    write_jsonl(out / "sft.jsonl", sft_rows)
    eval_labels = Counter(solve(a, true)[1] for _, a, true, _ in eval_set)
    top_label, top_count = eval_labels.most_common(1)[0]
    return {"train": len(train_set), "eval": len(eval_set), "sft": len(sft_rows),
            "eval constant-answer baseline": f"{100 * top_count / len(eval_set):.1f}% (always {top_label})"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/math_word", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sloppiness", type=float, default=0.7,
                        help="how often the SFT teacher adds the numbers instead of reading the words")
    parser.add_argument("--num-train", type=int, default=20000)
    parser.add_argument("--num-sft", type=int, default=16000)
    parser.add_argument("--num-eval", type=int, default=200)
    args = parser.parse_args()
    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    counts = make_data(out / "data", args.seed, args.sloppiness, args.num_train, args.num_sft, args.num_eval)
    tokenizer = build_char_tokenizer(chat_template=True)
    # Prompts run to ~130 tokens (one per character) and responses to 26: 256 positions hold both.
    build_tiny_model(out / "base", tokenizer, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=384, max_positions=256, seed=args.seed)
    print(f"[prepare] data {counts} and base model in {out}")


if __name__ == "__main__":
    main()
