"""docs/architecture.md's "Where a change goes" table, checked against the code: every file it names
exists, and the code that tells engine backends (or rollout schedules) apart by name sits only in the
files its row names, so adding one touches those files and no more."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

from tether.engine.backends import BACKENDS
from tether.engine.config import EngineConfig
from tether.rollout.config import Schedule

ROOT = Path(__file__).resolve().parents[2]
TABLE = (ROOT / "docs" / "architecture.md").read_text().split("## Where a change goes", 1)[1]


def rows() -> dict[str, str]:
    return {cells[0].strip(): cells[1] for line in TABLE.splitlines()
            if line.startswith("| ") and len(cells := line.strip("|").split("|")) >= 2}


def named_files(row: str) -> set[str]:
    """The paths a row names (`tether/...py`, or `name.py` beside the previous full path's folder)."""
    found, folder = set(), None
    for span in re.findall(r"`([^`]+)`", row):
        if span.startswith(("tether/", "tests/", "bench/", "scripts/", "docs/")):
            found.add(span.rstrip("/"))
            folder = str(Path(span).parent) if span.endswith(".py") else span.rstrip("/")
        elif re.fullmatch(r"[a-z_]+\.py", span) and folder:
            found.add(f"{folder}/{span}")
    return found


def variant_names(union) -> set[str]:
    return {v.model_fields[next(iter(k for k in ("backend", "mode") if k in v.model_fields))].default
            for v in get_args(get_args(union)[0])}


def branching_files(names: set[str]) -> set[str]:
    """Files under tether/ that compare against one of ``names`` or key a dict by it."""
    out = set()
    for path in (ROOT / "tether").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                values = [node.left, *node.comparators]
                values += [e for v in values if isinstance(v, (ast.Tuple, ast.List, ast.Set)) for e in v.elts]
            elif isinstance(node, ast.Dict):
                values = [k for k in node.keys if k is not None]
            else:
                continue
            if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                out.add(str(path.relative_to(ROOT)))
    return out


def test_every_named_file_exists():
    missing = {row: sorted(p for p in named_files(text) if not (ROOT / p).exists()) for row, text in rows().items()}
    assert not any(missing.values()), missing


@pytest.mark.parametrize("row, names", [
    ("a new engine backend", variant_names(EngineConfig)),
    ("a new rollout schedule (mode)", variant_names(Schedule)),
])
def test_code_that_names_a_variant_is_where_the_row_says(row, names):
    assert rows().get(row), f"docs/architecture.md has no row {row!r}"
    outside = branching_files(names) - named_files(rows()[row])
    assert not outside, f"{sorted(outside)} tell {sorted(names)} apart by name; the row {row!r} does not name them"


def test_the_registry_and_the_union_list_the_same_backends():
    assert variant_names(EngineConfig) == set(BACKENDS)
