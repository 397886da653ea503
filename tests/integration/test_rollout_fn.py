"""Custom rollout functions through the rollout manager, against a real engine server over HTTP
(the manager built in this process, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_config
from tether.config import ConfigError, config_from_dict
from tether.rollout.manager import RolloutManager, check_user_functions
from tether.rollout.rollout_fn import RolloutFnError

pytestmark = pytest.mark.integration
USER = Path(__file__).parent / "user_rollout.py"
GENERATE = Path(__file__).parent / "user_generate.py"


def manager(engine, tiny_model_dir, addition_data, tmp_path, fn: str | None, **rollout) -> RolloutManager:
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run")
    raw["rollout"].update(rollout, custom_rollout_fn=f"{USER}:{fn}" if fn else None)
    return RolloutManager(config_from_dict(raw).model_dump(mode="json"), [engine.url])


def tokens(batch):
    return [list(t) for t in batch.tokens]


def test_a_function_drawing_and_generating_gives_the_built_in_batch(engine, tiny_model_dir, addition_data, tmp_path):
    built_in = manager(engine, tiny_model_dir, addition_data, tmp_path / "a", None)
    mine = manager(engine, tiny_model_dir, addition_data, tmp_path / "b", "plain")
    for rollout_id in range(2):
        (want, want_metrics), (got, got_metrics) = built_in.generate(rollout_id), mine.generate(rollout_id)
        assert tokens(got) == tokens(want) and got.rewards == want.rewards  # scored by rollout.reward
        assert got.sample_ids == want.sample_ids
        # Same seeds, same tokens; log-probs to rounding (the engine batched the requests differently).
        assert all(a == pytest.approx(b, abs=1e-4) for a, b in zip(got.rollout_logprobs, want.rollout_logprobs))
        assert got_metrics["rollout/reward_mean"] == want_metrics["rollout/reward_mean"]
    assert mine.data.state_dict() == built_in.data.state_dict()


def test_groups_handed_back_come_first_and_survive_a_checkpoint(engine, tiny_model_dir, addition_data, tmp_path):
    m = manager(engine, tiny_model_dir, addition_data, tmp_path, "best_of_two")
    batch, metrics = m.generate(0)
    assert metrics["rollout/my_metric"] == 1.5 and len(batch.tokens) == 16
    handed_back = [g[0].prompt_index for g in m.buffer.groups]
    assert len(handed_back) == 4 and m.data.state_dict()["offset"] == 8
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    m.save_state(str(ckpt))
    resumed = manager(engine, tiny_model_dir, addition_data, tmp_path / "resumed", "best_of_two")
    resumed.load_state(str(ckpt))
    first, _ = m.generate(1)
    again, _ = resumed.generate(1)
    assert tokens(first) == tokens(again)
    assert [first.sample_ids[k][0] for k in range(0, 16, 4)] == handed_back  # the handed-back groups, first


def test_evaluation_uses_the_function_when_it_takes_evaluation(engine, tiny_model_dir, addition_data, tmp_path):
    m = manager(engine, tiny_model_dir, addition_data, tmp_path, "best_of_two")
    metrics = m.eval(3)  # the metric only its evaluation branch returns
    assert metrics["eval/add/my_eval_metric"] == 2.0 and 0.0 <= metrics["eval/add/score"] <= 1.0
    plain = manager(engine, tiny_model_dir, addition_data, tmp_path / "p", "plain").eval(3)  # built-in eval
    builtin = manager(engine, tiny_model_dir, addition_data, tmp_path / "b", None).eval(3)
    assert plain["eval/add/score"] == builtin["eval/add/score"] == metrics["eval/add/score"]


def test_a_sync_function_with_its_own_rewards_and_a_generate_function(engine, tiny_model_dir, addition_data, tmp_path):
    m = manager(engine, tiny_model_dir, addition_data, tmp_path, "sync_rollout",
                custom_generate_fn=f"{GENERATE}:two_turns", max_response_len=10)
    batch, _ = m.generate(0)
    assert batch.rewards == [0.0, 1.0, 2.0, 3.0] * 4  # set by the function: kept
    assert batch.loss_masks is not None and all(0 in mask for mask in batch.loss_masks)  # the inserted "<7>"


@pytest.mark.parametrize("fn, match", [
    ("raises", r"custom_rollout_fn '.*user_rollout.py:raises' raised KeyError: 'no such tool' at user_rollout.py:\d+ "
               r"\(rollout 0\)"),
    ("returns_text", r"returned 'groups' for rollout 0; expected a non-empty list of groups"),
    ("too_few", r"returned 4 samples \(1 groups of 4\); training takes a multiple of train.global_batch_size=8"),
    ("ungenerated", r"returned a sample that was never generated \(rollout 0, prompt_index=\d+, sample_index=0\)"),
])
def test_a_bad_function_names_itself_and_the_rollout(engine, tiny_model_dir, addition_data, tmp_path, fn, match):
    with pytest.raises(RolloutFnError, match=match):
        manager(engine, tiny_model_dir, addition_data, tmp_path, fn).generate(0)


def test_bad_specs_and_settings_are_config_errors(tiny_model_dir, addition_data, tmp_path):
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path)
    raw["rollout"]["custom_rollout_fn"] = f"{USER}:missing"
    with pytest.raises(ConfigError, match=r"rollout.custom_rollout_fn: .*missing"):
        check_user_functions(config_from_dict(raw))
    raw["rollout"].update(custom_rollout_fn=f"{USER}:plain", partial_rollout=True)
    with pytest.raises(ConfigError, match=r"rollout.partial_rollout is the built-in rollout's"):
        config_from_dict(raw)


def test_an_engine_without_load_counters_gives_no_hit_rate():
    from fastapi import FastAPI

    from tether.http.server import ThreadedServer
    from tether.rollout.fleet import EngineFleet, prefix_cache_metrics

    server = ThreadedServer(FastAPI(), "127.0.0.1", 0, "a server without /get_load").start()
    try:
        counters = EngineFleet([server.url], timeout_s=10).prefill_counters()
    finally:
        server.stop()
    assert set(counters.values()) == {0.0} and prefix_cache_metrics(counters, counters, "rollout") == {}
