#!/usr/bin/env bash
# The math-word recipe: word problems answered with a worked step and a \boxed{} number.
#   1. build data, a character tokenizer and a random 2-layer model (offline)
#   2. SFT on a sloppy teacher's answers (it adds the numbers 70% of the time, whatever the words say)
#   3. GRPO with the `math` reward; eval accuracy is printed before and after
# Works from any directory (it changes to the repo root); --overwrite replaces earlier runs in runs/math_word.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
python recipes/math_word/prepare.py --out runs/math_word
tether sft --config recipes/math_word/sft.yaml --overwrite
tether train --config recipes/math_word/grpo.yaml --overwrite
tether report runs/math_word/grpo
