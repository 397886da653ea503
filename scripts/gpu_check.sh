#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): engine, trainer, weight push and checkpoints on one GPU, no Ray.
#   bash scripts/gpu_check.sh OUT_DIR          # on a GPU machine; pure-Python wheels from .gpu_wheels/ (scripts/gpu_wheels.sh)
#   bash scripts/gpu_check.sh --cpu OUT_DIR    # the same checks on CPU, small (CI runs this)
# PYTHON: the interpreter (default python3, the one that has torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import pydantic, fastapi, uvicorn" 2>/dev/null; then
  if ! ls .gpu_wheels/*.whl >/dev/null 2>&1; then
    echo "gpu_check: $PY lacks pydantic/fastapi/uvicorn and .gpu_wheels/ has no wheels: run scripts/gpu_wheels.sh where pip reaches PyPI" >&2
    exit 2
  fi
  SITE="$(mktemp -d)/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu_wheels/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PY" scripts/gpu_check.py "$@"
