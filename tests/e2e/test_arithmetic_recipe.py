"""The quickstart recipe end to end through the CLI: prepare -> sft -> GRPO, and it must learn.

This is the README's first command minus the install: about 3 minutes on 2 cores.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import RECIPE, run

pytestmark = pytest.mark.e2e


def test_arithmetic_recipe_learns(arithmetic_sft):
    out = arithmetic_sft
    run("-m", "tether.cli", "train", "--config", str(RECIPE / "grpo.yaml"), f"output_dir={out}/grpo",
        f"model.path={out}/sft/hf", f"data.path={out}/data/train.jsonl",
        f"eval.datasets.0.path={out}/data/eval.jsonl")
    run("-m", "tether.cli", "report", str(out / "grpo"))
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    scores = [(r["step"], r["eval/add2/score"]) for r in rows if r.get("eval/add2/score") is not None]
    before, after = scores[0][1], scores[-1][1]
    assert scores[0][0] == 0 and scores[-1][0] == 40
    # The SFT model copies a teacher that forgets carries; RL must fix a good part of that.
    assert after - before >= 0.20, scores
    assert (out / "grpo" / "curves.png").is_file() and (out / "grpo" / "hf" / "model.safetensors").is_file()
    # `tether sft` scored the eval set at its end: the same model, the same greedy score as GRPO's step 0.
    sft_rows = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/add2/score"] for r in sft_rows if r.get("eval/add2/score") is not None] == [before]
    summary = json.loads((out / "grpo" / "summary.json").read_text())
    assert summary["run_name"] == "grpo"
    # A healthy run: none of the can't-learn warnings (constant rewards, dead groups, truncation, collapse).
    assert summary["warnings"] == [], summary["warnings"]
    sft_warnings = json.loads((out / "sft" / "summary.json").read_text())["warnings"]
    assert sft_warnings == [], sft_warnings
    # The eval's constant-answer baseline is far below what the model reaches: skill, not a constant.
    last = [r for r in rows if r.get("eval/add2/constant_answer_score") is not None][-1]
    assert last["eval/add2/constant_answer_score"] < 0.05
