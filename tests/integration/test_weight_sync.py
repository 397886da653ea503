"""After a weight push, the engine's log-probs for a sequence equal the trainer's (float32)."""

from __future__ import annotations

import pytest
import ray

from tests.conftest import tiny_config
from tether.batch import TrainBatch
from tether.cluster import plan_placement, wait
from tether.config import config_from_dict
from tether.engine.base import GenerateRequest
from tether.engine.sampling import SamplingParams
from tether.rollout.handle import create_engines
from tether.trainer.group import TrainerGroup

pytestmark = pytest.mark.integration


def engine_sample(engine, prompt, seed=7):
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    out = wait(engine.generate.remote([GenerateRequest(prompt, params)], seed), 60, "engine generate")[0]
    return out.output_ids, out.output_logprobs


@pytest.mark.parametrize("num_train_actors, transport", [(1, "object_store"), (2, "object_store"),
                                                         (2, "distributed")])
def test_engine_matches_trainer_after_sync(num_train_actors, transport, ray_session, tiny_model_dir, addition_data,
                                           tmp_path):
    cfg = config_from_dict(tiny_config(tiny_model_dir, addition_data, tmp_path,
                                       cluster={"num_train_actors": num_train_actors, "weight_sync": transport}))
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
        assert wait(engine.health.remote(), 30, "health")["weight_version"] == 1

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
