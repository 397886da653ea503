"""`tether sft` ends with the eval sets, `tether eval` scores an exported model or a checkpoint with
the same numbers a run logged, and `tether report` reads a run's before/after."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import tiny_config
from tether.cli import main

pytestmark = pytest.mark.integration


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def trained_run(ray_session, tiny_model_dir, addition_data, tmp_path_factory):
    """A 3-rollout GRPO run (checkpoints at 1 and 2, evals at 0, 2 and 3) and its config file."""
    tmp = tmp_path_factory.mktemp("eval_cli")
    config = tmp / "grpo.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_model_dir, addition_data, tmp / "run")))
    assert main(["train", "--config", str(config)]) == 0
    return tmp, config


def test_sft_runs_the_eval_sets_at_its_end(ray_session, tiny_model_dir, addition_data, tmp_path, capsys):
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "sft")
    raw.update(sft={"path": str(addition_data["sft"]), "batch_size": 16}, train={"lr": 1e-3, "micro_batch_size": 16})
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["sft", "--config", str(config)]) == 0
    logged = rows(tmp_path / "sft" / "metrics.jsonl")
    final = [r for r in logged if r.get("eval/add/score") is not None]
    assert len(final) == 1 and final[0]["step"] == 4  # 64 rows / 16 per step
    assert "eval/add/constant_answer_score" in final[0] and "eval/add/top_answer_share" in final[0]
    assert "add " in capsys.readouterr().out  # the scores table
    # `tether eval` on the exported model gives the same (greedy) score.
    assert main(["eval", "--config", str(config), "--model", str(tmp_path / "sft" / "hf"),
                 "--out", str(tmp_path / "ev")]) == 0
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["metrics"]["eval/add/score"] == final[0]["eval/add/score"]
    answers = json.loads((tmp_path / "ev" / "rollouts" / "eval_add_000000_answers.json").read_text())
    assert sum(a["count"] for a in answers) == 8 and set(answers[0]) == {"answer", "count", "mean_reward"}


def test_eval_of_a_checkpoint_matches_the_runs_last_eval(trained_run, tmp_path):
    tmp, config = trained_run
    logged = [r for r in rows(tmp / "run" / "metrics.jsonl") if r.get("eval/add/score") is not None]
    assert [r["step"] for r in logged] == [0, 2, 3]
    assert main(["eval", "--config", str(config), "--model", str(tmp / "run" / "checkpoints"),
                 "--out", str(tmp_path / "ev")]) == 0
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["model"] == str(tmp_path / "ev" / "model")  # exported from rollout_000002
    assert result["metrics"]["eval/add/score"] == logged[-1]["eval/add/score"]


def test_report_prints_before_after_and_best(trained_run, capsys):
    tmp, _ = trained_run
    assert main(["report", str(tmp / "run")]) == 0
    text = capsys.readouterr().out
    assert "add: " in text and "(step 0) ->" in text and "(step 3)" in text and "best" in text
    assert "constant answer" in text and str(tmp / "run" / "curves.png") in text
    assert main(["report", str(tmp / "nothing")]) == 2


def test_eval_with_n_samples_reports_pass_at_k_and_per_prompt_rates(trained_run, tmp_path, capsys):
    tmp, config = trained_run
    raw = yaml.safe_load(config.read_text())
    raw["eval"]["datasets"][0].update(n_samples_per_prompt=4, temperature=1.0, reward="f1", pass_threshold=0.5)
    sampled = tmp_path / "sampled.yaml"
    sampled.write_text(yaml.safe_dump(raw))
    assert main(["eval", "--config", str(sampled), "--model", str(tmp / "run" / "hf"), "--out", str(tmp_path / "ev")]) == 0
    metrics = json.loads((tmp_path / "ev" / "eval.json").read_text())["metrics"]
    prompts = rows(tmp_path / "ev" / "rollouts" / "eval_add_000000_prompts.jsonl")
    assert len(prompts) == 8 and all(p["n"] == 4 and 0 <= p["passed"] <= 4 for p in prompts)
    passes = [metrics[f"eval/add/pass@{k}"] for k in (1, 2, 3, 4)]
    assert passes == sorted(passes)  # more tries never pass less
    assert passes[0] == pytest.approx(sum(p["pass_rate"] for p in prompts) / 8)
    assert passes[3] == pytest.approx(sum(p["passed"] > 0 for p in prompts) / 8)
    out = capsys.readouterr().out
    assert "add: pass@1 " in out and "prompts by passes of 4: 0/4:" in out
