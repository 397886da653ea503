"""`tether report` on a run's metrics: before/after, best and where, baseline, warnings, curves."""

from __future__ import annotations

import json

from tether.tracking.report import report


def test_report_of_a_run(tmp_path, capsys):
    rows = [{"step": 0, "eval/add/score": 0.3, "eval/add/constant_answer_score": 0.02, "eval/add/top_answer_share": 0.1},
            {"step": 1, "rollout/reward_mean": 0.4},
            {"step": 10, "eval/add/score": 0.8, "eval/add/constant_answer_score": 0.02},
            {"step": 20, "eval/add/score": 0.7, "eval/add/constant_answer_score": 0.03, "eval/add/top_answer_share": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"warnings": [{"step": 3, "message": "all rewards 0\nmore"}]}))
    out = report(tmp_path)
    (e,) = out["evals"]
    assert (e["before"], e["before_step"], e["after"], e["after_step"]) == (0.3, 0, 0.7, 20)
    assert (e["best"], e["best_step"], e["constant_answer"], e["top_answer_share"]) == (0.8, 10, 0.03, 0.2)
    text = capsys.readouterr().out
    assert "add: 30.0% (step 0) -> 70.0% (step 20), +40.0 points; best 80.0% at step 10; constant answer 3.0%" in text
    assert "1 warning(s), the first: all rewards 0" in text
    assert (tmp_path / "curves.png").is_file()  # drawn when missing
