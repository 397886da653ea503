"""LoRA (tether/models/lora.py): which layers are adapted, the base kept intact, merged weights and
PEFT's adapter folder giving the adapted model's outputs, and one FSDP train step moving only adapters."""

from __future__ import annotations

import pytest
import torch

from tether.config import config_from_dict
from tether.models.hf import load_model
from tether.models.lora import (adapter_state, adapters_disabled, apply_lora, lora_layers, merged_tensors, save_peft_adapter,
                                target_names, trainable_count)
from tether.models.lora_config import LoRAConfig
from tether.trainer.optim import build_optimizer

IDS = torch.tensor([[5, 9, 17, 3, 22, 40, 7]])
PER_LAYER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def adapted(model_dir, **lora) -> tuple[torch.nn.Module, LoRAConfig]:
    """The tiny model with adapters whose B is random (a fresh adapter is exactly the base)."""
    torch.manual_seed(0)
    model = load_model(str(model_dir), "float32")
    cfg = LoRAConfig(rank=4, alpha=8, **lora)
    apply_lora(model, cfg)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0, 0.5)
    return model, cfg


@pytest.mark.parametrize("targets, expected", [
    ("all-linear", [f"model.layers.{i}.{n}" for i in range(2) for n in PER_LAYER]),
    (["q_proj", "v_proj"], [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_proj", "v_proj")]),
    (r"model\.layers\.1\.mlp\..*", [f"model.layers.1.{n}" for n in PER_LAYER[4:]]),
    (["layers.0.self_attn.o_proj"], ["model.layers.0.self_attn.o_proj"]),
])
def test_targets_follow_peft_rules(tiny_model_dir, targets, expected):
    model = load_model(str(tiny_model_dir), "float32")
    assert target_names(model, LoRAConfig(target_modules=targets)) == expected


def test_targets_matching_nothing_name_what_there_is(tiny_model_dir):
    model = load_model(str(tiny_model_dir), "float32")
    with pytest.raises(ValueError, match=r"model.lora.target_modules \['qproj'\] matches no linear layer of "
                                         r"tiny.*'down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj'"):
        target_names(model, LoRAConfig(target_modules=["qproj"]), "tiny")
    with pytest.raises(ValueError, match="lm_head"):  # the head is never adapted, even by name
        target_names(model, LoRAConfig(target_modules=["lm_head"]), "tiny")


def test_fresh_adapters_are_the_base_and_only_they_train(tiny_model_dir):
    base = load_model(str(tiny_model_dir), "float32")
    model = load_model(str(tiny_model_dir), "float32")
    names = apply_lora(model, LoRAConfig(rank=4))
    assert torch.equal(logits(model), logits(base))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{p}" for n in names for p in ("lora_A", "lora_B")}
    trained, total = trainable_count(model)
    assert trained == sum(4 * (layer.in_features + layer.out_features) for layer in lora_layers(model).values())
    assert total == sum(p.numel() for p in base.parameters()) + trained
    optimizer = build_optimizer(model, config_from_dict({"model": {"path": "m"}}).train)
    assert sum(p.numel() for group in optimizer.param_groups for p in group["params"]) == trained
    # the base's weights are the same tensors, under the same names
    assert dict(base.named_parameters()).keys() <= dict(model.named_parameters()).keys()


def test_adapters_off_is_the_base_and_merged_weights_are_the_adapted_model(tiny_model_dir):
    base = load_model(str(tiny_model_dir), "float32")
    model, _ = adapted(tiny_model_dir)
    assert not torch.allclose(logits(model), logits(base), atol=1e-3)
    with adapters_disabled(model):
        assert torch.equal(logits(model), logits(base))
    assert not torch.allclose(logits(model), logits(base), atol=1e-3)  # back on afterwards

    merged = dict(merged_tensors(model))
    assert merged.keys() == base.state_dict().keys()  # HF names only, no adapter tensors
    base.load_state_dict(merged)
    torch.testing.assert_close(logits(base), logits(model), atol=1e-5, rtol=1e-5)

    changed = dict(merged_tensors(model, only_adapted=True))
    assert sorted(changed) == sorted(f"{n}.weight" for n in lora_layers(model))
    assert all(torch.equal(changed[k], merged[k]) for k in changed)


def test_peft_loads_the_adapter_folder_to_the_same_outputs(tiny_model_dir, tmp_path):
    import peft  # a dev dependency: the adapter folder is checked against the package itself

    model, cfg = adapted(tiny_model_dir, target_modules="all-linear")
    out = save_peft_adapter(model, cfg, str(tiny_model_dir), tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(load_model(str(tiny_model_dir), "float32"), str(out))
    assert loaded.peft_config["default"].r == 4 and loaded.peft_config["default"].lora_alpha == 8
    torch.testing.assert_close(logits(loaded), logits(model), atol=1e-5, rtol=1e-5)


def test_the_zero_adapter_has_the_runs_shapes_and_changes_nothing(tiny_model_dir, tmp_path):
    """What a vLLM engine serves before the first push: shapes from the config alone, all zeros."""
    import peft
    from safetensors.torch import load_file

    from tether.models.lora import save_zero_adapter

    model, cfg = adapted(tiny_model_dir, target_modules=["q_proj", "down_proj"])
    out = save_zero_adapter(str(tiny_model_dir), cfg, torch.bfloat16, tmp_path / "zero")
    zero = load_file(str(out / "adapter_model.safetensors"))
    assert {k: tuple(v.shape) for k, v in zero.items()} == {k: tuple(v.shape) for k, v in adapter_state(model).items()}
    assert all(v.dtype == torch.bfloat16 and not v.any() for v in zero.values())
    base = load_model(str(tiny_model_dir), "float32")
    expected = logits(base)
    loaded = peft.PeftModel.from_pretrained(base, str(out))
    assert sorted(loaded.peft_config["default"].target_modules) == ["down_proj", "q_proj"]
    torch.testing.assert_close(logits(loaded), expected)


def test_an_fsdp_step_moves_only_the_adapters_and_the_reference_stays_the_base(tiny_model_dir, mesh):
    from tether.trainer.model import prepare_for_training

    cfg = config_from_dict({"model": {"path": str(tiny_model_dir), "lora": {"rank": 4, "target_modules": ["q_proj", "up_proj"]}},
                            "train": {"lr": 1e-2}})
    torch.manual_seed(0)
    model = prepare_for_training(load_model(str(tiny_model_dir), "float32"), cfg, mesh, "cpu")
    base = {n: t.clone() for n, t in merged_tensors(model)}
    optimizer = build_optimizer(model, cfg.train)
    for _ in range(2):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = dict(merged_tensors(model))
    moved = sorted(n for n in after if not torch.equal(after[n], base[n]))
    assert moved == sorted(f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "mlp.up_proj"))
    reference = load_model(str(tiny_model_dir), "float32")
    with adapters_disabled(model):
        torch.testing.assert_close(logits(model), logits(reference), atol=1e-6, rtol=1e-6)
