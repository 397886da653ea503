"""TRL's GRPOTrainer on one of bench/vs_trl.py's setups; run by bench/vs_trl.py in TRL's own venv.

    bench/.venv-trl/bin/python bench/trl_grpo.py SETUP.json OUT.json

SETUP.json gives the model directory, the prompt file (JSONL rows {"prompt", "label"}) and the
shared settings; OUT.json receives one row per optimizer step: its wall seconds and mean reward,
and the seconds from process start to the first step. This file imports TRL, not tether's training
stack; with "reward": "reasoning_gym" (bench/vs_trl_real.py) it calls tether's reasoning_gym reward
function itself (from "repo"), so both frameworks score replies alike. "chat": the prompts go to TRL as
chat messages (its chat-template path); "save_steps": the weights are saved that often.
"""

from __future__ import annotations

import json
import sys
import time

START = time.perf_counter()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def exact_match(completions: list[str], label: list[str], **_) -> list[float]:
    """1.0 when the completion is the label (stripped): tether's exact_match reward."""
    return [float(c.strip() == str(y).strip()) for c, y in zip(completions, label)]


def reasoning_gym_reward(repo: str):
    """tether's reasoning_gym reward (answer extraction + the task's own checker) as a TRL reward function."""
    sys.path.insert(0, repo)
    from tether.rewards.reasoning_gym import extract_answer, score

    def reward(completions: list, meta_json: list[str], **_) -> list[float]:
        out = []
        for completion, meta in zip(completions, meta_json):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            m = json.loads(meta)
            out.append(score(m["task"], m.get("settings") or {}, m["entry"], extract_answer(text, m["entry"].get("answer"))))
        return out

    return reward


class StepClock(TrainerCallback):
    """Wall time of each optimizer step (generation + scoring + forward/backward + optimizer), and the
    part of it in GRPOTrainer._generate_and_score_completions (generation, rewards, advantages, and the
    old-log-prob pass when one runs)."""

    def __init__(self):
        self.rows: list[dict] = []
        self.first_step_at: float | None = None
        self._began = 0.0
        self._generate_s = 0.0

    def time_generation(self, trainer: GRPOTrainer) -> None:
        inner = trainer._generate_and_score_completions

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._generate_s += time.perf_counter() - start

        trainer._generate_and_score_completions = timed

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = time.perf_counter()
        self._generate_s = 0.0
        if self.first_step_at is None:
            self.first_step_at = self._began - START

    def on_step_end(self, args, state, control, **kwargs):
        self.rows.append({"seconds": time.perf_counter() - self._began, "generate_s": self._generate_s})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs and self.rows:
            self.rows[-1]["reward"] = logs["reward"]


def main() -> None:
    setup = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(setup["threads"])
    rows = [json.loads(line) for line in open(setup["prompts"]) if line.strip()]
    chat = setup.get("chat", False)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}] if chat else r["prompt"],
                                  "label": str(r["label"]), "meta_json": json.dumps(r.get("metadata") or {})}
                                 for r in rows])
    reward = reasoning_gym_reward(setup["repo"]) if setup.get("reward") == "reasoning_gym" else exact_match
    saving = {"save_strategy": "steps", "save_steps": setup["save_steps"], "save_only_model": True} \
        if setup.get("save_steps") else {"save_strategy": "no"}
    batch = setup["prompts_per_step"] * setup["samples_per_prompt"]
    config = GRPOConfig(
        output_dir=setup["out_dir"], seed=setup["seed"], use_cpu=True, bf16=setup["bf16"], report_to=[],
        **saving, logging_steps=1, max_steps=setup["steps"], shuffle_dataset=True,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=setup["samples_per_prompt"], num_iterations=1,  # one optimizer step per generation
        max_completion_length=setup["max_new_tokens"], temperature=setup["temperature"], top_p=1.0,
        learning_rate=setup["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=setup["grad_clip"], beta=0.0, epsilon=setup["clip_low"], epsilon_high=setup["clip_high"],
        loss_type="dapo", scale_rewards="group", dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    clock.time_generation(trainer)
    trainer.train()
    with open(sys.argv[2], "w") as f:
        json.dump({"steps": clock.rows, "first_step_at_s": clock.first_step_at}, f)


if __name__ == "__main__":
    main()
