#!/usr/bin/env bash
# On-policy distillation: the quickstart's trained model (0.4M parameters, ~96% on held-out sums)
# teaches a smaller student (0.1M) that was fine-tuned on the sloppy teacher's answers. The student is
# trained twice from the same start, by GRPO alone and by GRPO with the teacher's per-token reverse KL
# in its advantages; summary.py prints both eval curves against wall-clock time.
#   bash recipes/distill/run.sh [extra overrides for both runs]
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
if [ ! -f runs/arithmetic/grpo/hf/config.json ]; then   # the teacher: the quickstart's result
  python recipes/arithmetic/prepare.py --out runs/arithmetic
  tether sft --config recipes/arithmetic/sft.yaml --overwrite
  tether train --config recipes/arithmetic/grpo.yaml --overwrite
fi
python recipes/distill/prepare.py --out runs/distill
tether sft --config recipes/arithmetic/sft.yaml --overwrite model.path=runs/distill/student_base \
  output_dir=runs/distill/sft
tether train --config recipes/distill/grpo.yaml --overwrite "$@"
tether train --config recipes/distill/grpo.yaml --overwrite output_dir=runs/distill/distilled \
  served_models.teacher.path=runs/arithmetic/grpo/hf teacher.model=teacher teacher.coef=0.1 "$@"
python recipes/distill/summary.py runs/distill/rl_only runs/distill/distilled
