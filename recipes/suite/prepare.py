"""Data, tokenizer and a random base model for one task of the learning suite (recipes/suite/tasks.py).

    python recipes/suite/prepare.py --task reverse --out runs/suite/reverse [--size tiny|4m]

Writes data/{train,eval,sft}.jsonl (eval prompts are held out from the others) and base/ (a random
Qwen2 with the character tokenizer). The SFT responses come from the task's sloppy teacher.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tasks import TASKS, Task, teacher  # noqa: E402

from tether.models.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402

SIZES = {  # the quickstart's model, one about ten times larger, and one about fifty times
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "4m": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768),
    "20m": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1536),
}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def unique_problems(task: Task, rng: random.Random, count: int) -> list:
    """Up to ``count`` problems with distinct prompts (fewer when the task has fewer)."""
    seen: dict[str, list] = {}
    for _ in range(count * 20):
        prompt, parts = task.make(rng)
        seen.setdefault(prompt, parts)
        if len(seen) == count:
            break
    return list(seen.items())


def make_data(task: Task, out: Path, seed: int, sloppiness: float, num_train: int, num_eval: int,
              num_sft: int) -> dict[str, int]:
    rng = random.Random(seed)
    problems = unique_problems(task, rng, num_train + num_eval)
    eval_set, train = problems[:num_eval], problems[num_eval:]
    row = lambda prompt, parts: {"prompt": prompt, "label": task.solve(parts)}  # noqa: E731
    write_jsonl(out / "eval.jsonl", [row(p, parts) for p, parts in eval_set])
    write_jsonl(out / "train.jsonl", [row(p, parts) for p, parts in train])
    sft = [{"prompt": p, "response": teacher(task, parts, rng, sloppiness)} for p, parts in rng.choices(train, k=num_sft)]
    write_jsonl(out / "sft.jsonl", sft)
    return {"train": len(train), "eval": len(eval_set), "sft": len(sft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sloppiness", type=float, default=0.7, help="how often the SFT teacher makes its mistake")
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--num-sft", type=int, default=16000)
    args = parser.parse_args()
    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    counts = make_data(TASKS[args.task], out / "data", args.seed, args.sloppiness, args.num_train, args.num_eval,
                       args.num_sft)
    build_tiny_model(out / "base", build_char_tokenizer(chat_template=False), max_positions=48, seed=args.seed,
                     **SIZES[args.size])
    print(f"[prepare] {args.task} ({args.size}): data {counts} and base model in {out}")


if __name__ == "__main__":
    main()
