"""train.compute_dtype: forward/backward in bfloat16 while the weights and the optimizer stay float32."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.unit.test_loss_mask import batches, settings
from tether.config import config_from_dict
from tether.models.hf import load_model
from tether.models.tiny import build_char_tokenizer, build_tiny_model
from tether.trainer.model import apply_fsdp, compute_dtype, prepare_for_training
from tether.trainer.step import train_on_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), build_char_tokenizer(), hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=128, max_positions=128)


def local_vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.to_local() if isinstance(p, DTensor) else p).detach().flatten() for p in model.parameters()])


def one_step(model_dir, mesh, dtype: torch.dtype | None, lr: float) -> tuple[torch.Tensor, torch.Tensor, dict, set]:
    torch.manual_seed(0)
    model = apply_fsdp(load_model(str(model_dir), "float32"), mesh, dtype)
    before = local_vector(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = train_on_batch(model, optimizer, scheduler, batches()[0], settings(), 0, 1)
    dtypes = {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters() if p.grad is not None}
    return before, local_vector(model), metrics, dtypes


def test_bfloat16_compute_keeps_float32_weights_and_follows_the_float32_step(model_dir, mesh):
    before, fp32, fp32_metrics, _ = one_step(model_dir, mesh, None, lr=0.1)
    _, mixed, mixed_metrics, dtypes = one_step(model_dir, mesh, torch.bfloat16, lr=0.1)
    assert dtypes == {torch.float32}  # weights, and the gradients the optimizer reads
    want, got = fp32 - before, mixed - before
    assert torch.nn.functional.cosine_similarity(want, got, dim=0) > 0.98
    assert (got - want).norm() < 0.2 * want.norm()
    assert mixed_metrics["train/loss"] == pytest.approx(fp32_metrics["train/loss"], abs=0.05)
    # The loss really was computed from bfloat16 matmuls: not bit-identical to float32.
    assert not torch.equal(mixed, fp32)


def test_updates_too_small_for_bfloat16_still_reach_the_float32_weights(model_dir, mesh):
    before, after, _, _ = one_step(model_dir, mesh, torch.bfloat16, lr=1e-5)
    moved = after != before
    assert moved.float().mean() > 0.5
    # Stored in bfloat16, almost none of these updates would survive rounding.
    assert (after.bfloat16() != before.bfloat16()).float().mean() < 0.5 * moved.float().mean()


def test_compute_dtype_is_a_cast_only_when_it_differs_from_the_model(tmp_path):
    def cfg(**train):
        return config_from_dict({"model": {"path": str(tmp_path)}, "data": {"path": str(tmp_path / "d.jsonl")},
                                 "train": train})

    assert compute_dtype(cfg()) is None
    assert compute_dtype(cfg(compute_dtype="float32")) is None
    assert compute_dtype(cfg(compute_dtype="bfloat16")) is torch.bfloat16


def test_bfloat16_training_on_cpu_uses_the_eager_attention_kernel(model_dir, mesh):
    # The CPU flash-attention backward is ~5x slower than eager attention in bfloat16 (not in float32);
    # a frozen model (no backward) keeps SDPA, whose bfloat16 forward is the faster one.
    def cfg(**train):
        return config_from_dict({"model": {"path": str(model_dir)}, "data": {"path": str(model_dir / "d.jsonl")},
                                 "train": train})

    def kernel(c, backward=True):
        model = prepare_for_training(load_model(str(model_dir), "float32"), c, mesh, "cpu", backward)
        return model.config._attn_implementation

    assert kernel(cfg(compute_dtype="bfloat16")) == "eager"
    assert kernel(cfg(compute_dtype="bfloat16"), backward=False) == "sdpa"
    assert kernel(cfg()) == "sdpa"


def test_bfloat16_on_a_cpu_without_bfloat16_units_is_warned_about(monkeypatch):
    from tether.config import config_from_dict
    from tether.run.preflight import bfloat16_without_units

    cfg = config_from_dict({"model": {"path": "m"}, "train": {"compute_dtype": "bfloat16"}})
    for module_fn in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, module_fn, lambda: False)
    assert "train.compute_dtype=bfloat16" in bfloat16_without_units(cfg)
    assert bfloat16_without_units(config_from_dict({"model": {"path": "m"}})) is None  # float32: nothing to say
    on_gpu = config_from_dict({"model": {"path": "m", "dtype": "bfloat16"}, "cluster": {"gpus_per_bundle": 1}})
    assert bfloat16_without_units(on_gpu) is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert bfloat16_without_units(cfg) is None  # a CPU with AMX: bfloat16 is the fast one
