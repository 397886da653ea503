"""After a weight push, the engine's log-probs for a sequence equal the trainer's (float32)."""

from __future__ import annotations

import httpx
import pytest
import ray
import torch

from tests.conftest import tiny_config
from tether.trainer.batch import TrainBatch
from tether.cluster import plan_placement, wait
from tether.config import config_from_dict
from tether.rollout.handle import create_engines
from tether.models.lora import merged_tensors
from tether.trainer.group import TrainerGroup

pytestmark = pytest.mark.integration


def engine_sample(engine, prompt, seed=7):
    """One sampled response and its log-probs, over the engine's HTTP API (as a rollout asks)."""
    url = wait(engine.url.remote(), 60, "engine url")
    reply = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": seed}})
    assert reply.status_code == 200, reply.text
    out = reply.json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def trainer_weights(trainer) -> dict[str, torch.Tensor]:
    """Rank 0's full weights (gathering them is a collective: every rank takes part)."""
    def gather(actor):
        return {name: t.clone() for name, t in merged_tensors(actor.model)}
    return wait([a.__ray_call__.remote(gather) for a in trainer.group.actors], 60, "trainer weights")[0]


def engine_weights(engine) -> dict[str, torch.Tensor]:
    return wait(engine.__ray_call__.remote(lambda actor: actor.engine.model.state_dict()), 60, "engine weights")


# The tiny model is ~100 KB: 0.02 MB buckets send it in several.
@pytest.mark.parametrize("num_train_actors, transport, bucket_mb", [(1, "object_store", 256), (2, "object_store", 0.02),
                                                                    (2, "distributed", 0.02)])
def test_engine_matches_trainer_after_sync(num_train_actors, transport, bucket_mb, ray_session, tiny_model_dir,
                                           addition_data, tmp_path):
    cfg = config_from_dict(tiny_config(tiny_model_dir, addition_data, tmp_path,
                                       cluster={"num_train_actors": num_train_actors, "weight_sync": transport,
                                                "weight_sync_bucket_mb": bucket_mb}))
    placement = plan_placement(cfg.cluster)
    trainer = TrainerGroup(cfg, placement)
    engine = create_engines(cfg, placement)[0]
    try:
        trainer.init(total_steps=10, with_ref=False, load_dir=None)
        trainer.connect_engines([engine])
        prompt = [5, 6, 7, 8]
        ids_before, lp_before = engine_sample(engine, prompt)

        # One SFT step with a large learning rate moves the weights visibly.
        batch = TrainBatch(tokens=[prompt + ids_before] * 4, prompt_lengths=[4] * 4, response_lengths=[len(ids_before)] * 4)
        trainer.train(0, ray.put(batch), policy_loss="sft", global_batch_size=4)
        stats = trainer.push_weights(version=1)
        assert stats["weight_sync/megabytes"] > 0
        assert (stats["weight_sync/buckets"] > 1) == (bucket_mb < 1)
        assert wait(engine.health.remote(), 30, "health")["weight_version"] == 1
        pushed, loaded = trainer_weights(trainer), engine_weights(engine)
        assert sorted(pushed) == sorted(loaded)
        assert all(torch.equal(pushed[name], loaded[name]) for name in pushed)  # bit for bit

        ids, engine_lp = engine_sample(engine, prompt)
        trainer_lp = trainer.score(TrainBatch(tokens=[prompt + ids], prompt_lengths=[4], response_lengths=[len(ids)]))[0]
        assert len(trainer_lp) == len(engine_lp) == len(ids)
        assert max(abs(a - b) for a, b in zip(trainer_lp, engine_lp)) < 1e-5
        # and the push really changed what the engine computes
        same_prefix = ids[: len(ids_before)] == ids_before[: len(ids)]
        assert not same_prefix or max(abs(a - b) for a, b in zip(lp_before, engine_lp)) > 1e-3
    finally:
        ray.kill(engine)
        trainer.shutdown()
        placement.remove()


@pytest.mark.parametrize("shared_memory", [True, False])
def test_object_store_sender_delivers_exact_weights(shared_memory, ray_session, tiny_model_dir):
    """Both ways of ObjectStoreSender (a shared-memory segment on this host, the object store), in
    buckets, over several pushes, with a tensor larger than a bucket."""
    from transformers import AutoModelForCausalLM

    from tether.engine.actor import EngineActor
    from tether.weight_sync.object_store import ObjectStoreSender

    engine = ray.remote(EngineActor).remote(str(tiny_model_dir), threads=1)
    try:
        state = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
        sender = ObjectStoreSender([engine], bucket_bytes=8 << 10, timeout_s=60, shared_memory=shared_memory)
        g = torch.Generator().manual_seed(0)
        for version in (1, 2):
            noise = {t.data_ptr(): torch.randn(t.shape, generator=g) for t in state.values()}  # tied: one noise
            pushed = {name: t + noise[t.data_ptr()] for name, t in state.items()}
            stats = sender.send(iter(pushed.items()), version)
            assert stats["weight_sync/buckets"] > 3
            assert wait(engine.health.remote(), 30, "health")["weight_version"] == version
            loaded = engine_weights(engine)
            assert all(torch.equal(pushed[name], loaded[name]) for name in pushed)
        assert (sender._segment is not None) == shared_memory
    finally:
        ray.kill(engine)
