"""Applying FSDP2 to an HF causal LM as a function, and gathering / saving its full weights.

The model has no distributed code; ``apply_fsdp`` shards each decoder layer and then the root
(torchtitan's way), so each layer's parameters are gathered just in time during forward/backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from tether.config import TetherConfig
from tether.models.hf import DTYPES
from tether.models.lora import apply_lora, merged_tensors

M = TypeVar("M", bound=nn.Module)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF causal LM (Llama/Qwen/Mistral style: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at model.model.layers")
    return list(layers)


def apply_fsdp(model: M, mesh: DeviceMesh, compute_dtype: torch.dtype | None = None) -> M:
    """Shard parameters over the mesh: one FSDP unit per decoder layer, one for the rest.

    With ``compute_dtype`` each unit's gathered parameters are cast to it for forward and backward,
    while the sharded parameters (what the optimizer updates and checkpoints save) keep their dtype
    and gradients are reduced in float32: mixed precision with master weights.
    """
    policy = MixedPrecisionPolicy() if compute_dtype is None else MixedPrecisionPolicy(
        param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def prepare_for_training(model: PreTrainedModel, cfg: TetherConfig, mesh: DeviceMesh, device: str,
                         backward: bool = True) -> PreTrainedModel:
    """The model as the trainer runs it: checkpointed activations, the attention kernel for its
    dtype, FSDP2 with train.compute_dtype. ``backward=False`` for frozen models (the reference)."""
    dtype = compute_dtype(cfg)
    lora = cfg.model.lora if backward else None
    if lora is not None:
        apply_lora(model, lora, cfg.model.path)
    if backward and cfg.model.gradient_checkpointing:
        # Non-reentrant: with a frozen base the recomputed block's inputs need no grad, and the reentrant
        # kind would then drop the adapters' gradients.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": lora is None})
    if cfg.train.attention != "auto":
        model.set_attn_implementation(cfg.train.attention)
    elif backward and device == "cpu" and (dtype or DTYPES[cfg.model.dtype]) == torch.bfloat16:
        # PyTorch's CPU flash-attention backward is slow in bfloat16: on SmolLM2's shape (16 x 9 heads
        # x 100 tokens) 32 ms against 11 in float32 and 6 for the plain matmul-softmax-matmul, which
        # made a bfloat16 step only 1.2x faster than float32 instead of 1.9x.
        model.set_attn_implementation("eager")
    return apply_fsdp(model, mesh, dtype)


def compute_dtype(cfg: TetherConfig) -> torch.dtype | None:
    """train.compute_dtype as a torch dtype; None when it is unset or model.dtype already (no cast)."""
    name = cfg.train.compute_dtype
    return None if name is None or name == cfg.model.dtype else DTYPES[name]


def save_hf(model: nn.Module, tokenizer: PreTrainedTokenizerBase, source_path: str, out_dir: str | Path, rank: int) -> None:
    """Write an HF-format model (safetensors, config, tokenizer). Collective: call on every rank."""
    state = {name: t.cpu().clone() for name, t in merged_tensors(model)}  # adapters merged
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
