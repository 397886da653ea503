#!/usr/bin/env bash
# The test suite: unit tests, CPU integration tests (Ray + gloo) and the tiny recipe end to end.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check tether tests recipes
.venv/bin/python -m mypy tether
exec .venv/bin/python -m pytest -q "$@"
