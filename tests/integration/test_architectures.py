"""The model families users bring, as transformers ships them, each small and randomly initialised at its
real vocabulary size: the embedded engine serves it, its log-probs equal the trainer's (float32), a
weight push changes its replies, and an FSDP checkpoint of it resumes. The families that cannot be
trained or served are refused by name before anything starts (tether/models/architectures.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

from tether.models.architectures import SUPPORTED, UnsupportedModel, check_architecture
from tether.trainer.batch import TrainBatch, collate
from tether.run.checkpoint import load_trainer, save_trainer
from tether.engine.core import start_engine_core
from tether.engine.embedded import EmbeddedEngine
from tether.engine.sampling import SamplingParams
from tether.models.hf import load_model
from tether.models.tiny import build_char_tokenizer
from tether.trainer.model import apply_fsdp
from tether.trainer.step import StepSettings, forward_logprobs, train_on_batch
from tether.algorithms.losses import LossParams

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
# name: (config class, model class, the family's real vocabulary size, extra config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", 128256, {}),  # Llama 3
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", 151936, {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", 151936, {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 151936,
                  {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mistral": ("MistralConfig", "MistralForCausalLM", 32768, {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", 256000, {"head_dim": 16, "final_logit_softcapping": 30.0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", 262144, {"head_dim": 16, "sliding_window": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", 32064, {}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    config_cls, model_cls, vocab, extra = FAMILIES[request.param]
    tokenizer = build_char_tokenizer()
    config = getattr(transformers, config_cls)(vocab_size=vocab, **SMALL, **extra, tie_word_embeddings=True,
                                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                               bos_token_id=None)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return request.param, out


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=False) for text in ("12+7=", "rev:abc=", "max:3 9 4=")]


def test_engine_serves_matches_the_trainer_and_takes_weights(family_dir):
    name, path = family_dir
    assert check_architecture(str(path)) == name
    core = start_engine_core(lambda: EmbeddedEngine(str(path)), max_batch=16, max_batch_tokens=4096)
    try:
        prompts = _prompts(core.tokenizer)
        params = [SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=i) for i in range(6)]
        outs = [r.future.result(timeout=120) for r in core.submit_many(
            [(prompts[i % 3], params[i], None) for i in range(6)])]
        assert all(len(o.output_ids) == 8 for o in outs)
        assert max(t for o in outs for t in o.output_ids) < FAMILIES[name][2]

        # engine log-probs == the trainer's recomputation (float32, the chunked LM head)
        batch = TrainBatch(tokens=[prompts[i % 3] + outs[i].output_ids for i in range(6)],
                           prompt_lengths=[len(prompts[i % 3]) for i in range(6)], response_lengths=[8] * 6)
        trainer_model = load_model(str(path), "float32")
        with torch.no_grad():
            mb = collate(batch, list(range(6)), 0)
            logprobs, _ = forward_logprobs(trainer_model, mb, 1.0, chunk_mb=1.0)
        for row, (r, start) in enumerate(mb.spans):
            got = torch.tensor(outs[row].output_logprobs)
            assert torch.allclose(got, logprobs[r, start : start + 8], atol=2e-5), (name, got, logprobs[r])

        # a weight push changes greedy replies
        greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        before = [core.generate(p, greedy, timeout_s=120).output_ids for p in prompts]
        update = {n: t.detach() + 0.5 * torch.randn_like(t) for n, t in trainer_model.state_dict().items()
                  if t.dtype.is_floating_point}

        def push() -> None:
            core.engine.load_weight_bucket(update, 1)
            core.engine.commit_weights(1)

        core.exclusive(push)
        after = [core.generate(p, greedy, timeout_s=120).output_ids for p in prompts]
        assert after != before and core.engine.weight_version == 1
    finally:
        core.shutdown()


def _settings() -> StepSettings:
    return StepSettings(micro_batch_size=2, global_batch_size=4, pad_id=0, grad_clip=1.0, policy_loss="ppo_clip",
                        loss_params=LossParams(), advantage_estimator="grpo", max_response_len=4)


def _local(model) -> torch.Tensor:
    return torch.cat([(p.to_local() if isinstance(p, DTensor) else p).detach().flatten() for p in model.parameters()])


def test_fsdp_training_step_and_checkpoint_resume(family_dir, mesh, tmp_path):
    _, path = family_dir
    batch = TrainBatch(tokens=[[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 13], [14, 15, 16, 17, 18, 19],
                               [14, 15, 16, 20, 21, 22]], prompt_lengths=[3] * 4, response_lengths=[3] * 4,
                       group_size=2, rewards=[1.0, 0.0, 0.0, 1.0],
                       rollout_logprobs=[[-1.0] * 3] * 4, temperature=1.0)

    def fresh():
        torch.manual_seed(0)
        model = apply_fsdp(load_model(str(path), "float32"), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    model, optimizer, scheduler = fresh()
    start = _local(model)
    metrics = train_on_batch(model, optimizer, scheduler, batch, _settings(), 0, 1)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert not torch.equal(_local(model), start)  # the step moved the weights
    save_trainer(tmp_path, model, optimizer, scheduler, 0)
    train_on_batch(model, optimizer, scheduler, batch, _settings(), 0, 1)
    want = _local(model)

    resumed, optimizer2, scheduler2 = fresh()
    load_trainer(tmp_path, resumed, optimizer2, scheduler2, 0, 1)
    train_on_batch(resumed, optimizer2, scheduler2, batch, _settings(), 0, 1)
    assert torch.equal(_local(resumed), want)  # the resumed run takes the same second step


@pytest.mark.parametrize("config_cls, model_cls", [("GPT2Config", "GPT2LMHeadModel"),
                                                   ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
                                                   ("OPTConfig", "OPTForCausalLM")])
def test_unsupported_families_are_refused_by_name(tmp_path, config_cls, model_cls):
    config = getattr(transformers, config_cls)(vocab_size=100)
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match=rf"model_type '{config.model_type}'.*supported: .*llama.*qwen2"):
        check_architecture(str(tmp_path))
    assert config.model_type not in SUPPORTED
