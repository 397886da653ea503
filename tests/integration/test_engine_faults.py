"""Engines that die or freeze mid-rollout: the run goes on, and trains on the samples it would have.

Each faulted run has one engine send itself SIGKILL or SIGSTOP on a /generate request in the
middle of rollout 0 (TETHER_ENGINE_FAULT). Its requests go to the other engine (or wait for the
replacement, when it was the only one), a new engine starts on its bundle with the trainer's
weights, and the run completes. Every sample has its own seed, so the trained samples are the ones
of an undisturbed run: same tokens, same rewards, the same samples trained in each rollout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_config
from tether.config import config_from_dict
from tether.errors import EngineDiedError
from tether.run.faults import ENGINE_FAULT, ENGINE_UPDATE_FAULT
from tether.train import train

pytestmark = pytest.mark.integration


def fault_config(model_dir, data, out: Path, engines: int, **cluster) -> dict:
    return tiny_config(model_dir, data, out, eval={"datasets": []}, checkpoint={"save_interval": 100},
                       cluster={"num_engines": engines, "colocate": False, "engine_health_interval_s": 0.5,
                                "engine_health_timeout_s": 3.0, **cluster})


def trained(out: Path) -> dict:
    """What the run trained on: per rollout, each sample's tokens and reward, and the sample ids."""
    rollouts = {}
    for path in sorted((out / "rollouts").glob("rollout_*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rollouts[path.name] = [(r["prompt_index"], r["sample_index"], r["response_ids"], r["reward"]) for r in rows]
    return {"rollouts": rollouts, "trained": (out / "trained_samples.jsonl").read_text()}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def undisturbed(ray_session, tiny_model_dir, addition_data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("undisturbed")
    train(config_from_dict(fault_config(tiny_model_dir, addition_data, out, engines=2)))
    return trained(out)


@pytest.mark.parametrize("engines,signal,weight_sync", [(2, "KILL", "distributed"), (2, "STOP", "object_store"),
                                                        (1, "STOP", "object_store")],
                         ids=["sigkill-of-2", "sigstop-of-2", "sigstop-of-the-only-one"])
def test_a_lost_engine_is_replaced_and_the_run_trains_the_same_samples(
        undisturbed, tiny_model_dir, addition_data, tmp_path, monkeypatch, capfd, engines, signal, weight_sync):
    out = tmp_path / "run"
    # The 2nd /generate request an engine gets is mid-rollout 0 (4 groups, one request each).
    monkeypatch.setenv(ENGINE_FAULT, f"{signal}:2:{tmp_path / 'fault_fired'}")
    train(config_from_dict(fault_config(tiny_model_dir, addition_data, out, engines, weight_sync=weight_sync)))
    assert (tmp_path / "fault_fired").exists()
    err = capfd.readouterr().err
    assert "lost:" in err and "starting a replacement on its bundle (engine restart 1/3)" in err
    if signal == "STOP":
        assert "no answer to /health_generate within 3s (frozen)" in err
    rows = metrics(out)
    assert rows[-1]["faults/engine_restarts"] == 1.0
    if engines == 2:  # the lost engine's requests were sent to the other one
        assert sum(r.get("faults/samples_reissued", 0) for r in rows) > 0
    assert trained(out) == undisturbed


@pytest.mark.parametrize("weight_sync", ["object_store", "distributed"])
def test_an_engine_lost_during_a_weight_push_is_replaced_and_the_push_made_again(
        undisturbed, tiny_model_dir, addition_data, tmp_path, monkeypatch, capfd, weight_sync):
    # The 2nd weight bucket an engine loads is the push after rollout 0 (one bucket a push): it dies
    # there. The replacement gets the trainer's current weights, the push is made again to both.
    out = tmp_path / "run"
    monkeypatch.setenv(ENGINE_UPDATE_FAULT, f"2:{tmp_path / 'fault_fired'}")
    train(config_from_dict(fault_config(tiny_model_dir, addition_data, out, 2, weight_sync=weight_sync)))
    assert (tmp_path / "fault_fired").exists()
    err = capfd.readouterr().err
    assert "lost: it died during the weight push (" in err and "(engine restart 1/3)" in err
    rows = metrics(out)
    assert [r.get("faults/engines_replaced_in_push") for r in rows if "faults/engines_replaced_in_push" in r] == [1.0]
    assert rows[-1]["faults/engine_restarts"] == 1.0
    # Engines and trainer agree on every token afterwards: the replacement serves the pushed weights.
    assert max(r["mismatch/logprob_abs_diff_max"] for r in rows if "mismatch/logprob_abs_diff_max" in r) < 1e-4
    assert trained(out) == undisturbed


def test_past_max_engine_restarts_the_run_ends_naming_the_engine(ray_session, tiny_model_dir, addition_data,
                                                                  tmp_path, monkeypatch):
    monkeypatch.setenv(ENGINE_FAULT, f"KILL:2:{tmp_path / 'fault_fired'}")
    raw = fault_config(tiny_model_dir, addition_data, tmp_path / "run", engines=1, max_engine_restarts=0)
    with pytest.raises(EngineDiedError) as err:
        train(config_from_dict(raw))
    text = str(err.value)
    assert "engine 0 (pid " in text and "died" in text and "last lines of" in text
