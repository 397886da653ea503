"""Served models (served_models:): frozen engines beside the policy's, reached by name from rewards.

A judge model (another model than the policy) scores every sample of a real run; its verdicts are the
ones the same model gives when asked directly. Its engine, killed mid-rollout, is replaced like a
policy engine and the run finishes. A reward naming a model the config does not serve stops the run
before anything starts, naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import engine_server, tiny_config
from tether.config import ConfigError, config_from_dict
from tether.run.faults import ENGINE_FAULT
from tether.rollout.user_functions import check_user_functions
from tether.train import train

pytestmark = pytest.mark.integration
JUDGE = Path(__file__).parent / "user_judge.py"


def judged_config(model_dir: Path, judge_dir: Path, data: dict, out: Path, reward: str = "judge", **cluster) -> dict:
    raw = tiny_config(model_dir, data, out, eval={"datasets": []}, checkpoint={"save_interval": 100},
                      cluster={"num_engines": 1, "colocate": False, "engine_health_interval_s": 0.5,
                               "engine_health_timeout_s": 3.0, **cluster},
                      rollout={"num_rollout": 2, "reward": f"{JUDGE}:{reward}"})
    raw["served_models"] = {"judge": {"path": str(judge_dir)}}
    return raw


def dumped(out: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((out / "rollouts").glob("rollout_*.jsonl"))
            for line in path.read_text().splitlines()]


def test_a_judge_model_scores_every_sample_of_a_run(ray_session, tiny_model_dir, vllm_model_dir, addition_data, tmp_path):
    out = tmp_path / "run"
    train(config_from_dict(judged_config(tiny_model_dir, vllm_model_dir, addition_data, out)))
    rows = dumped(out)
    assert len(rows) == 2 * 16 and all("verdict" in r["metadata"] for r in rows)
    # The verdicts are the judge model's own: asked directly, it says the same of each exchange.
    with engine_server(vllm_model_dir) as judge:
        for r in rows[:8]:
            reply = httpx.post(f"{judge.url}/generate", json={"text": r["prompt"] + r["response_text"],
                                                              "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}},
                               timeout=60).json()
            assert reply["text"] == r["metadata"]["verdict"]
            assert r["reward"] == sum(c.isdigit() for c in reply["text"]) / 4
    assert len({r["metadata"]["verdict"] for r in rows}) > 1  # it judged, not a constant


def test_a_sync_reward_reaches_the_judge_by_chat(ray_session, tiny_model_dir, vllm_model_dir, addition_data, tmp_path):
    out = tmp_path / "run"
    raw = judged_config(tiny_model_dir, vllm_model_dir, addition_data, out, reward="judge_sync")
    raw["rollout"]["num_rollout"] = 1
    train(config_from_dict(raw))
    rows = dumped(out)
    assert len(rows) == 16 and all(r["reward"] is not None for r in rows)
    with engine_server(vllm_model_dir) as judge:
        r = rows[0]
        reply = httpx.post(f"{judge.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": f"Is {r['response_text']!r} equal to {r['label']}?"}],
            "max_tokens": 4, "temperature": 0.0}).json()
        assert r["reward"] == sum(c.isdigit() for c in reply["choices"][0]["message"]["content"]) / 4


def test_a_lost_judge_engine_is_replaced_and_the_run_finishes(ray_session, tiny_model_dir, vllm_model_dir, addition_data,
                                                              tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    # The policy's engine gets 4 requests a rollout (one a group); the judge's gets one a sample, so
    # the 10th request any engine gets is the judge's, mid-rollout 0.
    monkeypatch.setenv(ENGINE_FAULT, f"KILL:10:{tmp_path / 'fault_fired'}")
    train(config_from_dict(judged_config(tiny_model_dir, vllm_model_dir, addition_data, out)))
    assert (tmp_path / "fault_fired").exists()
    err = capfd.readouterr().err
    assert "engine of served model 'judge'" in err and "starting a replacement on its bundle (engine restart 1/3)" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["faults/engine_restarts"] == 1.0
    assert len(dumped(out)) == 2 * 16


def test_a_reward_naming_an_unserved_model_stops_before_the_start(tiny_model_dir, vllm_model_dir, addition_data, tmp_path):
    cfg = config_from_dict(judged_config(tiny_model_dir, vllm_model_dir, addition_data, tmp_path, reward="misnamed"))
    with pytest.raises(ConfigError, match=r"rollout.reward: .*user_judge.py:\d+ uses the served model 'juge', which "
                                          r"the config does not serve \(served_models: judge\)"):
        check_user_functions(cfg)
