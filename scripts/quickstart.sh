#!/usr/bin/env bash
# The quickstart: teach a small Qwen2 model two-digit addition on this CPU.
#   1. build data, a character tokenizer and a random 2-layer model (offline)
#   2. SFT on a sloppy teacher's answers (it forgets to carry 70% of the time)
#   3. GRPO with an exact-match reward; eval accuracy is printed before and after
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
python recipes/arithmetic/prepare.py --out runs/arithmetic
tether sft --config recipes/arithmetic/sft.yaml --overwrite      # --overwrite: a rerun replaces the last one
tether train --config recipes/arithmetic/grpo.yaml --overwrite
tether report runs/arithmetic/grpo
