#!/usr/bin/env bash
# The pure-Python packages the GPU check needs beyond what a bare GPU machine has (PyTorch, transformers,
# safetensors, numpy, httpx, pyarrow, pytest on Python 3.12): wheels for CPython 3.12 on x86-64 Linux,
# into .gpu_wheels/ (git-ignored), at the versions this checkout's environment uses. Run where pip
# reaches PyPI; then take .gpu_wheels/ along with the checkout:
#   bash scripts/gpu_wheels.sh [DIR]
# It fails when the wheels and the checkout's tracked files together pass 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpu_wheels}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# What tether imports that such a machine lacks: config (pydantic, PyYAML), the engine's HTTP server
# (FastAPI, uvicorn) and chat templates (Jinja2); their own requirements come with them.
PACKAGES=(pydantic=="$(version pydantic)" fastapi=="$(version fastapi)" uvicorn=="$(version uvicorn)"
          pyyaml=="$(version pyyaml)" jinja2=="$(version jinja2)")
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$OUT" "${PACKAGES[@]}"
wheels=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
checkout=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
total=$((wheels + checkout))
printf 'gpu_wheels: %d wheels, %.1f MiB; with the checkout %.1f MiB of 64\n' "$(ls "$OUT"/*.whl | wc -l)" \
  "$(echo "$wheels / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
ls "$OUT"
[ "$total" -le $((64 * 1024 * 1024)) ] || { echo "gpu_wheels: over 64 MiB" >&2; exit 1; }
