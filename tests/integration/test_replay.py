"""`tether rollout` saves rollouts without training; `debug.load_rollouts` trains on saved ones without
engines and reaches the weights of the run that generated them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_config
from tether.config import config_from_dict
from tether.train import generate_rollouts, train

pytestmark = pytest.mark.integration


def config(tiny_model_dir, addition_data, out, num_rollout=2, **sections):
    raw = tiny_config(tiny_model_dir, addition_data, out, eval={"interval": None, "datasets": []},
                      rollout={"num_rollout": num_rollout}, **sections)
    raw["deterministic"] = True
    return config_from_dict(raw)


def responses(path):
    return [json.loads(line)["response_ids"] for line in path.read_text().splitlines()]


def test_replayed_rollouts_reach_the_live_weights(ray_session, tiny_model_dir, addition_data, tmp_path):
    live = tmp_path / "live"
    train(config(tiny_model_dir, addition_data, live))
    replayed = tmp_path / "replayed"
    train(config(tiny_model_dir, addition_data, replayed, debug={"load_rollouts": str(live / "rollouts")}))
    a, b = load_file(str(live / "hf" / "model.safetensors")), load_file(str(replayed / "hf" / "model.safetensors"))
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(a[k], start[k]) for k in a)  # it trained
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise the same weights
    rows = [json.loads(line) for line in (replayed / "metrics.jsonl").read_text().splitlines()]
    live_rows = [json.loads(line) for line in (live / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in rows if "train/loss" in r] == [r["train/loss"] for r in live_rows if "train/loss" in r]

    # `tether rollout` samples the starting policy as the live run's first rollout did.
    saved = tmp_path / "saved"
    generate_rollouts(config(tiny_model_dir, addition_data, saved, num_rollout=1))
    assert responses(saved / "rollouts" / "rollout_000000.jsonl") == responses(live / "rollouts" / "rollout_000000.jsonl")


def test_replay_names_a_missing_rollout(ray_session, tiny_model_dir, addition_data, tmp_path):
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "rollout_000000.jsonl").write_text('{"prompt_index": 0}\n')
    with pytest.raises(Exception, match="rollout_000000.jsonl:1: not a saved sample"):
        train(config(tiny_model_dir, addition_data, tmp_path / "run", debug={"load_rollouts": str(saved)}))
