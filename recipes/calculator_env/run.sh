#!/usr/bin/env bash
# The calculator_env recipe: the calculator task as a TRL environment class (rollout.environment).
#   1. build data (chat conversations), a character tokenizer with a chat template, a random model
#   2. SFT on a sloppy teacher's conversations; the eval at the end plays the environment greedily ("before")
#   3. GRPO, every sample an episode of env.py:CalculatorEnv; eval accuracy before and after
# Works from any directory (it changes to the repo root); --overwrite replaces earlier runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
python recipes/calculator_env/prepare.py --out runs/calculator_env
tether sft --config recipes/calculator_env/sft.yaml --overwrite
tether train --config recipes/calculator_env/grpo.yaml --overwrite
tether report runs/calculator_env/grpo
