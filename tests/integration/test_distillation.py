"""On-policy distillation end to end: an engine's scores of a prompt equal a direct forward of its model;
a run whose teacher is the policy's own starting model sees a reverse KL of zero before its first
update and the teacher's scores are that model's; the loss form trains; a teacher with another
tokenizer stops the run before it starts."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import engine_server, tiny_config
from tether.config import ConfigError, config_from_dict
from tether.models.hf import load_model
from tether.run.preflight import check_inputs
from tether.train import train

pytestmark = pytest.mark.integration


def direct_logprobs(model_dir: Path, ids: list[int], temperature: float = 1.0) -> list[float]:
    """Each token's log-prob after the ones before it, from a plain HF forward (float32)."""
    model = load_model(str(model_dir), "float32").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_an_engine_scores_a_prompt_as_a_direct_forward(tiny_model_dir, temperature):
    sequences = [[5, 9, 17, 3, 22, 40, 7, 11], [30, 31, 32, 33, 34]]
    with engine_server(tiny_model_dir) as server:
        reply = httpx.post(f"{server.url}/generate", timeout=60, json={
            "input_ids": sequences, "return_logprob": True, "logprob_start_len": [0, 2],
            "sampling_params": [{"max_new_tokens": 0, "temperature": temperature}] * 2}).json()
        refused = httpx.post(f"{server.url}/generate", timeout=60, json={
            "input_ids": sequences[0], "sampling_params": {"max_new_tokens": 0}})
    first, second = (r["meta_info"]["input_token_logprobs"] for r in reply)
    assert [e[1] for e in first] == sequences[0] and first[0][0] is None  # position 0 has no log-prob
    assert [e[1] for e in second] == sequences[1][2:]
    want = direct_logprobs(tiny_model_dir, sequences[0], temperature)
    assert max(abs(a - b) for a, b in zip([e[0] for e in first[1:]], want)) < 1e-5
    want = direct_logprobs(tiny_model_dir, sequences[1], temperature)[1:]
    assert max(abs(a - b) for a, b in zip([e[0] for e in second], want)) < 1e-5
    assert refused.status_code == 422 and "max_new_tokens: 0 generates nothing" in refused.text


def test_score_calls_of_one_turn_go_out_as_one_request(tiny_model_dir):
    """A rollout's groups call score as they finish together: one request carries them all, each caller
    gets its own sequences' scores (equal to a direct forward), and a refused request fails every caller."""
    import asyncio

    from tether.rollout.served import ServedModel
    from tether.served import ServedModelError

    groups = [[[5, 9, 17, 3, 22], [5, 9, 40, 7]], [[30, 31, 32, 33]], [[8, 9, 10, 11, 12, 13]]]
    with engine_server(tiny_model_dir) as server:
        model = ServedModel("teacher", [server.url], 60.0)
        sent: list[int] = []
        send = model.router.generate_async

        async def counted(client, payload):
            sent.append(len(payload["input_ids"]))
            return await send(client, payload)

        model.router.generate_async = counted  # type: ignore[method-assign]

        async def all_groups():
            return await asyncio.gather(*(model.score(g, [2] * len(g)) for g in groups))

        scores = asyncio.run(all_groups())
        assert sent == [4]  # one request for the four sequences of three calls
        for group, got in zip(groups, scores):
            for seq, values in zip(group, got):
                want = direct_logprobs(tiny_model_dir, seq)[1:]
                assert len(values) == len(seq) - 2 and max(abs(a - b) for a, b in zip(values, want)) < 1e-5

        async def one_bad():  # a token id past the vocabulary: the engine refuses the whole request
            return await asyncio.gather(model.score([[5, 6, 7]], [1]), model.score([[5, 10**6, 7]], [1]),
                                        return_exceptions=True)

        results = asyncio.run(one_bad())
        assert all(isinstance(r, ServedModelError) for r in results), results
        model.close()


def distill_config(model_dir: Path, teacher_dir: Path, data: dict, out: Path, mode: str = "advantage") -> dict:
    raw = tiny_config(model_dir, data, out, eval={"datasets": []}, checkpoint={"save_interval": 100},
                      cluster={"colocate": False}, rollout={"num_rollout": 2})
    raw["served_models"] = {"teacher": {"path": str(teacher_dir)}}
    raw["teacher"] = {"model": "teacher", "coef": 0.5, "mode": mode}
    return raw


def test_a_teacher_that_is_the_starting_policy_has_zero_kl_before_the_first_update(
        ray_session, tiny_model_dir, addition_data, tmp_path):
    out = tmp_path / "run"
    train(config_from_dict(distill_config(tiny_model_dir, tiny_model_dir, addition_data, out)))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/teacher_kl" in r]
    assert len(trained) == 2
    assert abs(trained[0]["train/teacher_kl"]) < 1e-5  # same weights, same tokens: the same log-probs
    assert abs(trained[1]["train/teacher_kl"]) > 1e-4  # the policy has moved since
    dump = [json.loads(line) for line in (out / "rollouts" / "rollout_000000.jsonl").read_text().splitlines()]
    for sample in dump[:4]:  # the teacher's scores of the sampled tokens are its model's own
        ids = sample["prompt_ids"] + sample["response_ids"]
        want = direct_logprobs(tiny_model_dir, ids)[len(sample["prompt_ids"]) - 1:]
        assert len(sample["teacher_logprobs"]) == len(sample["response_ids"])
        assert max(abs(a - b) for a, b in zip(sample["teacher_logprobs"], want)) < 1e-5


def test_the_loss_form_trains_against_another_model(ray_session, tiny_model_dir, vllm_model_dir, addition_data, tmp_path):
    out = tmp_path / "run"
    train(config_from_dict(distill_config(tiny_model_dir, vllm_model_dir, addition_data, out, mode="loss")))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/teacher_kl_loss"] for r in rows if "train/teacher_kl_loss" in r]
    assert len(losses) == 2 and all(v > 0.01 for v in losses)  # another random model: far from the policy


def test_a_teacher_with_another_tokenizer_stops_the_run_before_it_starts(tiny_model_dir, smollm2_dir, addition_data,
                                                                        tmp_path):
    cfg = config_from_dict(distill_config(tiny_model_dir, smollm2_dir, addition_data, tmp_path))
    with pytest.raises(ConfigError, match=r"teacher.model 'teacher' \(.*SmolLM2.*\) has another tokenizer than "
                                          r"model.path .*: 49152 tokens against 99"):
        check_inputs(cfg, "train")
