"""LoRA: low-rank adapters on an HF causal LM's linear layers, without a wrapper model.

A targeted ``nn.Linear`` is swapped for a ``LoRALinear`` holding the same frozen ``weight`` and
``bias`` Parameters plus ``lora_A`` / ``lora_B``. So the model keeps its class and every HF name
(``model.layers.0.self_attn.q_proj.weight``): FSDP, the trainer's forward, the reference pass and the
weight push see the model they always saw. What leaves the trainer is named as the base model or as
PEFT names it: merged weights for engines and HF exports (``merged_tensors``), a PEFT adapter folder
(``save_peft_adapter``) that PEFT, vLLM and SGLang load.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from tether.models.lora_config import ALL_LINEAR, LoRAConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's names: the wrapper's base_model, then the HF model
LORA_PARAMS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """``F.linear(x, W, b) + scaling * B(A(dropout(x)))``; W and b are the base layer's own Parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as PEFT and nn.Linear: B = 0 keeps the base
        self.scaling = alpha / rank
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_on = True  # off: the base layer (the reference policy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_on:
            return out
        return out + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def _linear_names(model: nn.Module) -> list[str]:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head]


def matches(name: str, targets: list[str] | str) -> bool:
    """PEFT's rule: a list entry matches the dotted name or its tail after a dot; a string is a
    regular expression over the whole name; 'all-linear' matches every (non-head) linear layer."""
    if targets == ALL_LINEAR:
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def target_names(model: nn.Module, cfg: LoRAConfig, source: str = "the model") -> list[str]:
    """The linear layers ``cfg`` adapts; an error naming the field and what there is when none."""
    linears = _linear_names(model)
    chosen = [name for name in linears if matches(name, cfg.target_modules)]
    if not chosen:
        tails = sorted({name.rpartition(".")[2] for name in linears})
        raise ValueError(f"model.lora.target_modules {cfg.target_modules!r} matches no linear layer of {source}; "
                         f"its linear layers are named {tails} (the output head is never adapted)")
    return chosen


def apply_lora(model: nn.Module, cfg: LoRAConfig, source: str = "the model") -> list[str]:
    """Freeze the model and put adapters on the targeted linear layers, in place; returns their names."""
    names = target_names(model, cfg, source)
    model.requires_grad_(False)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), cfg.rank, cfg.alpha, cfg.dropout))
    return names


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model: the reference policy of a LoRA run (a model without adapters is unchanged)."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.adapter_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_on = True


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor; gathering a sharded DTensor is a collective every rank must run."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def merged_weight(layer: LoRALinear) -> torch.Tensor:
    """W + scaling B A in W's dtype (computed in float32). Collective under FSDP."""
    weight, a, b = _full(layer.weight), _full(layer.lora_A), _full(layer.lora_B)
    # One fused pass over W (addmm): a push merges every adapted layer, and on CPU a separate product,
    # scale and sum made a LoRA push 2x slower than sending the same bytes unmerged.
    return torch.addmm(weight.float(), b.float(), a.float(), alpha=layer.scaling).to(weight.dtype)


def merged_tensors(model: nn.Module, only_adapted: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) as the base model names them, each adapted weight merged; the adapters'
    own tensors never appear. ``only_adapted``: just the merged weights (all that a LoRA step changes).
    Without adapters: every parameter and persistent buffer, as they are. Collective under FSDP: every
    rank iterates it in the same order."""
    layers = lora_layers(model)
    if only_adapted:
        for name, layer in layers.items():
            yield f"{name}.weight", merged_weight(layer)
        return
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in layers and leaf in LORA_PARAMS:
            continue
        if owner in layers and leaf == "weight":
            yield name, merged_weight(layers[owner])
        else:
            yield name, _full(tensor)


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, full tensor) of every adapter (``base_model.model.<layer>.lora_A.weight``): what a
    push to an engine serving them as a LoRA carries. Collective under FSDP: every rank iterates it."""
    for name, layer in lora_layers(model).items():
        for param in LORA_PARAMS:
            yield f"{PEFT_PREFIX}{name}.{param}.weight", _full(getattr(layer, param))


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' full tensors under PEFT's names, in host memory (a folder's worth)."""
    return {name: t.cpu().contiguous() for name, t in adapter_tensors(model)}


def peft_config(cfg: LoRAConfig, names: list[str], base: str) -> dict:
    """adapter_config.json as PEFT writes it for a causal LM (the fields its loaders read)."""
    targets = cfg.target_modules
    if targets == ALL_LINEAR:  # PEFT writes the layers it found, not the shorthand
        targets = sorted({name.rpartition(".")[2] for name in names})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "use_rslora": False, "use_dora": False}


def save_peft_adapter(model: nn.Module, cfg: LoRAConfig, base: str, out_dir: str | Path) -> Path:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors). Collective under FSDP;
    write it from one rank."""
    state = adapter_state(model)
    if not state:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(cfg, list(lora_layers(model)), base)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def adapter_shapes(model_path: str, cfg: LoRAConfig) -> dict[str, tuple[int, int]]:
    """{PEFT name: shape} of the adapters ``cfg`` puts on the model at ``model_path``, from a model
    built on the meta device (its config only; no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    apply_lora(model, cfg, model_path)
    return {name: tuple(t.shape) for name, t in adapter_tensors(model)}  # type: ignore[misc]


def save_zero_adapter(model_path: str, cfg: LoRAConfig, dtype: torch.dtype, out_dir: str | Path) -> Path:
    """A PEFT folder of adapters that change nothing (A = B = 0): what an engine serving the policy
    as a LoRA serves before the first push, so every request names the adapter from the start."""
    shapes = adapter_shapes(model_path, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: torch.zeros(shape, dtype=dtype) for name, shape in shapes.items()}, str(out / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    names = [name[len(PEFT_PREFIX):].rpartition(".lora_")[0] for name in shapes]
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg, sorted(set(names)), model_path), indent=2) + "\n")
    return out


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (for the start-up line)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
