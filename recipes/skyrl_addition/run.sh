#!/usr/bin/env bash
# The skyrl_addition recipe: two-digit addition played in skyrl-gym's gsm8k_multi_turn environment.
#   1. build SkyRL-format data, a character tokenizer with a chat template, a random model
#   2. SFT on a sloppy teacher's two-turn conversations; the eval at the end plays the environment ("before")
#   3. GRPO, every sample an episode of the environment; eval before and after
# Works from any directory (it changes to the repo root); --overwrite replaces earlier runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
python recipes/skyrl_addition/prepare.py --out runs/skyrl_addition
tether sft --config recipes/skyrl_addition/sft.yaml --overwrite
tether train --config recipes/skyrl_addition/grpo.yaml --overwrite
tether report runs/skyrl_addition/grpo
