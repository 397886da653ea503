"""Applying FSDP2 to an HF causal LM as a function, and gathering / saving its full weights.

The model has no distributed code; ``apply_fsdp`` shards each decoder layer and then the root
(torchtitan's way), so each layer's parameters are gathered just in time during forward/backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF causal LM (Llama/Qwen/Mistral style: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at model.model.layers")
    return list(layers)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard parameters over the mesh: one FSDP unit per decoder layer, one for the rest."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter and persistent buffer.

    Gathering a sharded DTensor is a collective: every rank must iterate this in the same order.
    """
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


def save_hf(model: nn.Module, tokenizer: PreTrainedTokenizerBase, source_path: str, out_dir: str | Path, rank: int) -> None:
    """Write an HF-format model (safetensors, config, tokenizer). Collective: call on every rank."""
    state = {name: t.cpu().clone() for name, t in full_tensors(model)}
    if rank != 0:
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(source_path)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    fresh.load_state_dict(state, strict=True, assign=True)
    fresh.tie_weights()
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
