"""The quickstart's prepared data and SFT model, made once and shared by the recipe runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "arithmetic"


def run(*args: str) -> None:
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, timeout=900)


@pytest.fixture(scope="session")
def arithmetic_sft(tmp_path_factory) -> Path:
    """recipes/arithmetic prepared and SFT-trained: <out>/data, <out>/base, <out>/sft (hf/ inside)."""
    out = tmp_path_factory.mktemp("arith")
    run(str(RECIPE / "prepare.py"), "--out", str(out))
    run("-m", "tether.cli", "sft", "--config", str(RECIPE / "sft.yaml"), f"output_dir={out}/sft",
        f"model.path={out}/base", f"sft.path={out}/data/sft.jsonl", "tracking.tensorboard=false",
        f"eval.datasets.0.path={out}/data/eval.jsonl")
    return out
