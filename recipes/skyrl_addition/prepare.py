"""Builds the skyrl_addition recipe, offline: SkyRL-format data, a character tokenizer with a chat template,
a small model.

The quickstart's task (two-digit addition, "37+48=" -> "85") played in skyrl-gym's
``gsm8k_multi_turn`` environment (the package's own, unchanged): the model answers in GSM8K's strict
format ``#### 85``; a wrong answer gets the environment's format credit and its request for the final
answer, and the model has a second turn:

    user: 37+48=<eos>assistant: #### 75<eos>user: Now provide only the final numeric answer in the
    exact format: '#### ANSWER'.<eos>assistant: #### 85<eos>

The rows are SkyRL's (``prompt`` as chat messages, ``env_class``, ``reward_spec``), loaded as they
are. The supervised data is the quickstart's sloppy teacher, who forgets to carry 70% of the time, on
both turns; the environment's message between them is read from the environment itself.

    python recipes/skyrl_addition/prepare.py --out runs/skyrl_addition
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import skyrl_gym

from tether.models.tiny import build_char_tokenizer, build_tiny_model

ENV = "gsm8k_multi_turn"
TURNS = 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}<eos>"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def add_without_carry(a: int, b: int) -> int:
    """Digit-wise sum mod 10: what you write if you never carry."""
    out, scale = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * scale
        a, b, scale = a // 10, b // 10, scale * 10
    return out


def second_turn_request() -> str:
    """What the environment says after a wrong first answer (asked of the environment, not copied)."""
    env = skyrl_gym.make(ENV, env_config={}, extras={"reward_spec": {"ground_truth": "2"}, "max_turns": TURNS})
    env.init([{"role": "user", "content": "1+1="}])
    return env.step("#### 3")["observations"][0]["content"]


def row(a: int, b: int) -> dict:
    """A SkyRL dataset row."""
    return {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "env_class": ENV, "data_source": "addition",
            "reward_spec": {"method": "rule", "ground_truth": str(a + b)}}


def teacher(a: int, b: int, rng: random.Random, sloppiness: float, request: str) -> list[dict]:
    messages = [{"role": "user", "content": f"{a}+{b}="}]
    for turn in range(TURNS):
        answer = add_without_carry(a, b) if rng.random() < sloppiness else a + b
        messages.append({"role": "assistant", "content": f"#### {answer}"})
        if answer == a + b or turn == TURNS - 1:
            return messages
        messages.append({"role": "user", "content": request})
    return messages


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def make_data(out: Path, seed: int, sloppiness: float, num_sft: int, num_eval: int) -> dict[str, int]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    eval_pairs, train_pairs = pairs[:num_eval], pairs[num_eval:]
    write_jsonl(out / "eval.jsonl", [row(a, b) for a, b in eval_pairs])
    write_jsonl(out / "train.jsonl", [row(a, b) for a, b in train_pairs])
    request = second_turn_request()
    sft = [{"messages": teacher(a, b, rng, sloppiness, request)} for a, b in rng.choices(train_pairs, k=num_sft)]
    write_jsonl(out / "sft.jsonl", sft)
    return {"train": len(train_pairs), "eval": len(eval_pairs), "sft": len(sft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/skyrl_addition", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sloppiness", type=float, default=0.7, help="how often the SFT teacher forgets carries")
    parser.add_argument("--num-sft", type=int, default=16000)
    parser.add_argument("--num-eval", type=int, default=200)
    args = parser.parse_args()
    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    counts = make_data(out / "data", args.seed, args.sloppiness, args.num_sft, args.num_eval)
    tokenizer = build_char_tokenizer(chat_template=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    # A 27-token prompt, two turns and the environment's request (~110 tokens) in 160 response tokens.
    build_tiny_model(out / "base", tokenizer, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=384, max_positions=192, seed=args.seed)
    print(f"[prepare] data {counts} and base model in {out}")


if __name__ == "__main__":
    main()
