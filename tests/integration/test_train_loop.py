"""The real loop with Ray actors, FSDP2 over gloo and the embedded engine, on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import USER_REWARD, tiny_config
from tests.integration.reward_server import RewardServer
from tether.run.checkpoint import find_latest
from tether.config import config_from_dict
from tether.train import train

pytestmark = pytest.mark.integration

LAYOUTS = {
    "1actor-colocated": {"num_train_actors": 1, "colocate": True},
    "2actors-colocated": {"num_train_actors": 2, "colocate": True},
    "1actor-disaggregated": {"num_train_actors": 1, "colocate": False},
    "2actors-disaggregated-2engines-broadcast": {"num_train_actors": 2, "colocate": False, "num_engines": 2,
                                                 "weight_sync": "distributed"},
    "1actor-colocated-offload-kl": {"num_train_actors": 1, "colocate": True, "offload": True},
}
# Extra sections per layout: the KL loss (with a reference model) and the entropy bonus ride along once.
EXTRA = {"1actor-colocated-offload-kl": {"algorithm": {"kl_loss_coef": 0.01, "kl_loss_type": "k3", "entropy_coef": 0.001}}}


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loop_runs_and_learns_something(layout, ray_session, tiny_model_dir, addition_data, tmp_path):
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run", cluster=LAYOUTS[layout], **EXTRA.get(layout, {}))
    summary = train(config_from_dict(raw))

    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    assert steps == [0, 1, 2, 3], steps  # baseline eval at 0, then one row per rollout
    assert "eval/add/score" in rows[0] and "eval/add/score" in rows[2] and "eval/add/score" in rows[3]
    for row in rows[1:]:
        for key in ("rollout/reward_mean", "train/loss", "train/grad_norm", "train/entropy",
                    "mismatch/logprob_abs_diff_mean", "timing/weight_sync_s"):
            assert row.get(key) is not None, (key, row)
        # float32 engine and trainer compute the same log-probs for the same tokens
        assert row["mismatch/logprob_abs_diff_max"] < 1e-4, row
        if layout in EXTRA:
            assert row.get("train/kl") is not None  # measured against the frozen reference
    assert summary["plot"] and (tmp_path / "run" / "curves.png").stat().st_size > 1000

    # Each dumped sample says which rollout, group, status and engine weights produced it; the
    # weights are new at every rollout (pushed after each train step) and one version per rollout.
    versions = []
    for k in (0, 1, 2):
        dumped = read_rows(tmp_path / "run" / "rollouts" / f"rollout_{k:06d}.jsonl")
        assert {d["rollout_id"] for d in dumped} == {k}
        assert [d["group_index"] for d in dumped] == [g for g in range(4) for _ in range(4)], dumped
        assert all(d["status"] == {"stop": "completed", "length": "truncated"}[d["finish_reason"]] for d in dumped)
        assert len({tuple(d["weight_versions"]) for d in dumped}) == 1 and len(dumped[0]["weight_versions"]) == 1
        versions.append(dumped[0]["weight_versions"][0])
    assert versions == sorted(set(versions)), versions

    # The exported model differs from the starting one: training changed the weights.
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "hf" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    # Checkpoints at the save interval and at the last rollout.
    latest = find_latest(tmp_path / "run" / "checkpoints")
    assert latest is not None and latest[1] == 2
    assert (tmp_path / "run" / "checkpoints" / "rollout_000001").is_dir()


def test_save_then_load_continues(ray_session, tiny_model_dir, addition_data, tmp_path):
    out = tmp_path / "run"
    first = tiny_config(tiny_model_dir, addition_data, out, rollout={"num_rollout": 2}, checkpoint={"save_interval": 1})
    train(config_from_dict(first))
    assert find_latest(out / "checkpoints")[1] == 1
    data_state = json.loads((out / "checkpoints" / "rollout_000001" / "data_source.json").read_text())
    assert data_state["data"]["offset"] == 8  # two rollouts of 4 prompts were drawn

    # Extend the run to 4 rollouts and resume: rollouts 2 and 3 run, nothing before them again.
    second = tiny_config(tiny_model_dir, addition_data, out, rollout={"num_rollout": 4},
                         checkpoint={"save_interval": 1, "load": str(out / "checkpoints")})
    train(config_from_dict(second))
    steps = [r["step"] for r in read_rows(out / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4], steps  # the resumed run appended steps 3 and 4 only
    assert find_latest(out / "checkpoints")[1] == 3
    rollouts = sorted(p.name for p in (out / "rollouts").glob("rollout_*.jsonl"))
    assert rollouts == [f"rollout_00000{i}.jsonl" for i in range(4)]
    # The resumed rollouts drew the next prompts of the epoch, not the first ones again.
    prompts = [sorted({json.loads(l)["prompt_index"] for l in (out / "rollouts" / r).read_text().splitlines()})
               for r in rollouts]
    assert len({tuple(p) for p in prompts}) == 4


ESTIMATORS = {  # estimator -> the algorithm section that exercises it
    "grpo": {"loss_agg_mode": "token_mean"},
    "dr_grpo": {"loss_agg_mode": "seq_mean_token_sum_norm"},
    "gspo": {"policy_loss": "gspo", "eps_clip_low": 3e-4, "eps_clip_high": 4e-4, "loss_agg_mode": "seq_mean_token_mean"},
    "rloo": {"dual_clip_c": 3.0, "rollout_correction": "token_clip"},
    "reinforce_pp": {"kl_in_reward_coef": 0.01, "gamma": 0.99},
    "reinforce_pp_baseline": {"kl_in_reward_coef": 0.01, "rollout_correction": "sequence_mask"},
    "gae": {"lam": 0.95},  # PPO with the critic (also trained, saved and resumed below)
}


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_each_estimator_runs_two_rollouts(estimator, ray_session, tiny_model_dir, addition_data, tmp_path):
    # DAPO's overlong shaping rides along with Dr. GRPO (4-token responses, the last 2 penalised)
    shaping = {"overlong_buffer_len": 2} if estimator == "dr_grpo" else {}
    packing = {"max_tokens_per_micro_batch": 24} if estimator == "grpo" else {}  # and GRPO trains packed
    # PPO's policy and critic, and REINFORCE++'s reference, compute in bfloat16 over float32 weights
    mixed = {"compute_dtype": "bfloat16"} if estimator in ("gae", "reinforce_pp") else {}
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run", train={**packing, **mixed},
                      rollout={"num_rollout": 2, **shaping}, eval={"datasets": []}, checkpoint={"save_interval": None},
                      algorithm={"advantage_estimator": estimator, **ESTIMATORS[estimator]})
    train(config_from_dict(raw))
    rows = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(row[k] == row[k] for k in ("train/loss", "train/pg_loss", "train/grad_norm")), row  # not NaN
        assert row["train/adv_mean"] == row["train/adv_mean"]
        assert row["train/grad_norm"] > 0, row
        assert ("rollout/overlong_penalty_mean" in row) == bool(shaping)
        # float32 engines against the trainer's bfloat16 (or float32) forward
        assert 0 < row["mismatch/logprob_abs_diff_mean"] < 0.1 if mixed else row["mismatch/logprob_abs_diff_mean"] < 1e-4
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "hf" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert {t.dtype for t in after.values()} == {torch.float32}  # the weights stay in model.dtype


def test_ppo_with_a_critic_trains_saves_and_resumes(ray_session, tiny_model_dir, addition_data, tmp_path):
    """gae: the value model trains beside the policy, and is checkpointed and restored with it."""
    def config(num_rollout, load=None):
        return config_from_dict(tiny_config(
            tiny_model_dir, addition_data, tmp_path / "run", rollout={"num_rollout": num_rollout},
            eval={"datasets": []}, checkpoint={"save_interval": 1, "load": load},
            algorithm={"advantage_estimator": "gae", "gamma": 1.0, "lam": 0.95, "kl_in_reward_coef": 0.01},
            critic={"lr": 1e-2, "value_clip": 0.5}))

    train(config(2))
    rows = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["train/critic/value_loss"] > 0 and row["train/critic/grad_norm"] > 0, row
    # the zero-initialised head starts at V = 0; after an update the values have moved
    assert rows[0]["train/adv_value_mean"] == 0.0 and rows[1]["train/adv_value_mean"] != 0.0
    assert find_latest(tmp_path / "run" / "checkpoints")[1] == 1
    train(config(3, load=str(tmp_path / "run" / "checkpoints")))  # the critic's state comes back too
    rows = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["train/critic/value_loss"] > 0


def test_dynamic_sampling_keeps_exactly_prompts_per_rollout_groups(ray_session, tiny_model_dir, addition_data,
                                                                   tmp_path):
    """DAPO's filter: groups whose rewards are all equal (even labels score 1 everywhere) are dropped and
    more groups are started until 4 pass; the data position moves past exactly the prompts used."""
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run", eval={"interval": None, "datasets": []},
                      rollout={"num_rollout": 2, "reward": f"{USER_REWARD}:constant_when_label_is_even",
                               "dynamic_filter": "nonzero_reward_std", "over_sampling_groups": 6,
                               "max_concurrent_groups": 3})
    train(config_from_dict(raw))
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")[1:]
    for row, k in zip(rows, (0, 1)):
        dumped = read_rows(tmp_path / "run" / "rollouts" / f"rollout_{k:06d}.jsonl")
        assert [d["group_index"] for d in dumped] == [g for g in range(4) for _ in range(4)]
        groups = [dumped[g * 4:(g + 1) * 4] for g in range(4)]
        assert all(len({d["reward"] for d in g}) > 1 for g in groups)
        assert all(int(g[0]["label"]) % 2 == 1 for g in groups)
        assert row["rollout/groups_kept"] == 4
        assert row["rollout/groups_started"] >= 4 + row["rollout/groups_dropped"]
    assert sum(row.get("rollout/groups_dropped/all_correct", 0) for row in rows) >= 1


@pytest.mark.parametrize("keep_order", ["start", "finish"])
def test_partial_rollout_continues_aborted_groups_under_new_weights(keep_order, ray_session, tiny_model_dir,
                                                                    addition_data, tmp_path):
    """Streaming, 6 groups started for 2 kept: groups still generating when the 2 are known are aborted
    on the engine, wait in the buffer, and a later rollout continues them under newer weights. Their
    trained responses hold spans from two or more weight versions; mask_offpolicy_partial leaves the
    older spans out of the loss. Kept in start order or as they finish, every group started is trained
    on, dropped or carried over."""
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run", eval={"interval": None, "datasets": []},
                      checkpoint={"save_interval": None},
                      rollout={"num_rollout": 5, "prompts_per_rollout": 2, "over_sampling_groups": 6,
                               "max_response_len": 40, "partial_rollout": True, "mask_offpolicy_partial": True,
                               "keep_order": keep_order})
    train(config_from_dict(raw))
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")[1:]
    assert sum(r["rollout/groups_aborted"] for r in rows) >= 1
    assert [r["rollout/groups_continued"] for r in rows][1:] == [4] * 4  # the buffer's 4 groups go first
    multi = 0
    for k, row in enumerate(rows):
        dumped = read_rows(tmp_path / "run" / "rollouts" / f"rollout_{k:06d}.jsonl")
        masked = 0
        for d in dumped:
            versions, spans = d["weight_versions"], d["span_lengths"]
            assert len(versions) == len(spans) and sum(spans) == d["response_length"], d
            assert versions == sorted(set(versions)) and versions[-1] <= k, d  # each call under newer weights
            assert d["status"] in ("completed", "truncated") and d["rollout_id"] == k
            expected = [int(v == versions[-1]) for v, n in zip(versions, spans) for _ in range(n)]
            assert (d["loss_mask"] or [1] * d["response_length"]) == expected, d
            masked += expected.count(0)
            multi += len(versions) > 1
        assert row["rollout/offpolicy_tokens_masked"] == masked
        assert row["rollout/multi_version_samples"] == sum(len(d["weight_versions"]) > 1 for d in dumped)
        assert row["train/loss"] == row["train/loss"] and row["train/grad_norm"] > 0
    assert multi >= 1, "no trained response was continued across a weight update"
    trained = {d["prompt_index"] for k in range(5)
               for d in read_rows(tmp_path / "run" / "rollouts" / f"rollout_{k:06d}.jsonl")}
    assert len(trained) == 5 * 2  # 2 groups per rollout, no prompt trained twice


def test_a_remote_reward_model_scores_the_rollouts(ray_session, tiny_model_dir, addition_data, tmp_path):
    """rollout.reward as a URL: the rollout manager's actor posts each group to a reward server, retrying
    the 503 it gets first; the reward_key entry is trained on and the whole dict is kept and logged."""
    server = RewardServer()
    server.fail_next = 1
    try:
        raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run", eval={"interval": None, "datasets": []},
                          checkpoint={"save_interval": None},
                          rollout={"num_rollout": 2, "reward": f"{server.url}/score", "reward_key": "score"})
        train(config_from_dict(raw))
    finally:
        server.close()
    assert len(server.requests) == 1 + 2 * 4  # one per group (4 per rollout) and the retried one
    assert all(len(body["samples"]) == 4 for body in server.requests)
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")[1:]
    for k, row in enumerate(rows):
        dumped = read_rows(tmp_path / "run" / "rollouts" / f"rollout_{k:06d}.jsonl")
        assert all(d["reward"] == float(bool(d["response_text"])) for d in dumped)
        assert all(d["reward_info"] == {"score": d["reward"], "length": d["response_length"]} for d in dumped)
        assert row["rollout/reward/length_mean"] == row["rollout/response_len_mean"]


def test_a_multi_turn_generate_function_in_a_run(ray_session, tiny_model_dir, addition_data, tmp_path):
    """rollout.custom_generate_fn: two policy turns around the calculator's answer, driven by a custom
    rollout function (which hands half its groups back). The inserted tokens are dumped with loss mask 0
    and log-prob 0, and the engine/trainer mismatch, measured on policy tokens only, stays at rounding
    (the trainer sees the exact tokens every turn conditioned on). That masked tokens add nothing to the
    gradient: tests/unit/test_loss_mask.py."""
    here = Path(__file__).parent
    raw = tiny_config(tiny_model_dir, addition_data, tmp_path / "run", checkpoint={"save_interval": None},
                      rollout={"num_rollout": 2, "max_response_len": 10,
                               "custom_generate_fn": f"{here / 'user_generate.py'}:calculator_turns",
                               "custom_rollout_fn": f"{here / 'user_rollout.py'}:best_of_two"},
                      eval={"interval": 1})
    train(config_from_dict(raw))
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    for k, row in enumerate(r for r in rows if "train/loss" in r):
        assert row["mismatch/logprob_abs_diff_max"] < 1e-4, row
        assert row["rollout/my_metric"] == 1.5 and row["rollout/sample/tool_calls_mean"] == 1.0
        assert 0.0 <= row["rollout/prefix_cache_hit_rate"] <= 1.0
        dumped = read_rows(tmp_path / "run" / "rollouts" / f"rollout_{k:06d}.jsonl")
        for d in dumped:
            mask, lps, ids = d["loss_mask"], d["response_logprobs"], d["response_ids"]
            answer = f"<{eval(d['prompt'].rstrip('='))}>"  # noqa: S307 - the test's own "a+b=" prompts
            inserted = [t for t, m in zip(ids, mask) if m == 0]
            assert inserted == tokenizer_ids(tiny_model_dir, answer) and answer in d["response_text"], d
            assert all(lp == 0.0 for m, lp in zip(mask, lps) if m == 0)
    assert "eval/add/score" in rows[-1] and rows[-1]["eval/add/my_eval_metric"] == 2.0  # the function's eval


def tokenizer_ids(model_dir, text: str) -> list[int]:
    from tether.models.hf import load_tokenizer

    return load_tokenizer(str(model_dir)).encode(text, add_special_tokens=False)
