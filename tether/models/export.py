"""`tether export CKPT OUT`: a checkpoint's model as an HF directory (safetensors, config, tokenizer).

Runs in one process without torch.distributed: DCP reads the sharded model into a full state dict.
CKPT may be one checkpoint (rollout_000012/) or a checkpoint root (the latest complete one is used).
A LoRA run's checkpoint holds its adapters only: the base comes from the run's model.path, and the
export is the merged model, or with ``adapter=True`` a PEFT adapter folder.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tether.models.hf import DTYPES, load_model
from tether.models.lora import apply_lora, merged_tensors, save_peft_adapter
from tether.models.lora_config import LoRAConfig
from tether.models.source import resolve_model
from tether.run.checkpoint import HF_CONFIG, META, find_latest, read_meta
from tether.run.safe_load import SafeLoadPlanner, SafeReader


def resolve_checkpoint(source: str | Path) -> Path:
    path = Path(source)
    if (path / META).is_file():
        return path
    found = find_latest(path)
    if found is None:
        raise FileNotFoundError(f"{source}: neither a checkpoint nor a directory holding a complete one")
    return found[0]


def _load_saved(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Fill ``state`` (the model's trained tensors) in place from the checkpoint, without running code
    from the files."""
    reader = SafeReader(str(path / "train"))
    reader.read_metadata()
    dcp.load({"train": {"model": state}}, storage_reader=reader, planner=SafeLoadPlanner())


def export_checkpoint(source: str | Path, out_dir: str | Path, adapter: bool = False) -> Path:
    path = resolve_checkpoint(source)
    meta = read_meta(path)
    model_cfg = meta["config"]["model"]
    # The checkpoint carries the model's config and tokenizer; the original directory is the fallback.
    hf_dir = path / HF_CONFIG if (path / HF_CONFIG / "config.json").is_file() else Path(model_cfg["path"])
    out_dir = Path(out_dir)
    if model_cfg.get("lora"):
        _export_lora(path, model_cfg, out_dir, adapter)
    elif adapter:
        raise ValueError(f"{path}: --adapter needs a LoRA run's checkpoint; this run trained every weight "
                         "(model.lora was not set)")
    else:
        config = AutoConfig.from_pretrained(hf_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[model_cfg["dtype"]])
        state = model.state_dict()
        _load_saved(path, state)
        model.load_state_dict(state)
        model.tie_weights()
        model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    return out_dir


def _export_lora(path: Path, model_cfg: dict, out_dir: Path, adapter: bool) -> None:
    """The base (model.path) with the checkpoint's adapters: merged into an HF model, or as PEFT's folder."""
    base = resolve_model(model_cfg["path"])
    lora = LoRAConfig.model_validate(model_cfg["lora"])
    model = load_model(base, model_cfg["dtype"])
    apply_lora(model, lora, base)
    # The adapters' parameters themselves (detached views), which DCP fills in place.
    _load_saved(path, {name: p.detach() for name, p in model.named_parameters() if p.requires_grad})
    if adapter:
        save_peft_adapter(model, lora, model_cfg["path"], out_dir)
        return
    merged = dict(merged_tensors(model))
    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=DTYPES[model_cfg["dtype"]])
    fresh.load_state_dict(merged, strict=True, assign=True)
    fresh.tie_weights()
    fresh.save_pretrained(out_dir)
