#!/usr/bin/env bash
# The calculator recipe: a tiny model learns, by RL, to call a calculator tool (multi-turn rollouts).
#   1. build data, a character tokenizer and a random 2-layer model (offline)
#   2. SFT on a sloppy teacher's traces (it skips the tool 60% of the time, drops a digit 25%); the
#      tool's output is input only; the eval at the end runs the multi-turn rollout greedily ("before")
#   3. GRPO with an exact-match reward on the final answer; eval accuracy is printed before and after
# Works from any directory (it changes to the repo root); --overwrite replaces earlier runs in runs/calculator.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
python recipes/calculator/prepare.py --out runs/calculator
tether sft --config recipes/calculator/sft.yaml --overwrite
tether train --config recipes/calculator/grpo.yaml --overwrite
tether report runs/calculator/grpo
