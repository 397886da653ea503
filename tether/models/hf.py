"""Loading an HF causal LM and its tokenizer from a local directory.

Below the parts that use it (trainer, engines, rollout manager, export), and free of distributed
code: an engine or the rollout manager importing it does not pay for FSDP's imports.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def load_model(path: str, dtype: str, device: str = "cpu") -> PreTrainedModel:
    """An HF causal LM from a local directory; a missing or foreign directory gets a clear error."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path={path!r} is not a directory with an HF config.json")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    except ValueError as err:
        if "scaled_dot_product_attention" not in str(err):
            raise
        # Gemma 2 soft-caps its attention scores, which torch's fused attention cannot do
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="eager")
    # transformers declares PreTrainedModel.to with functools.wraps(nn.Module.to), which mypy reads as
    # the unbound function (self first); it is the bound method and returns the model.
    return model.to(device)  # type: ignore[arg-type]
