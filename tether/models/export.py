"""`tether export CKPT OUT`: a checkpoint's model as an HF directory (safetensors, config, tokenizer).

Runs in one process without torch.distributed: DCP reads the sharded model into a full state dict.
CKPT may be one checkpoint (rollout_000012/) or a checkpoint root (the latest complete one is used).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tether.run.checkpoint import HF_CONFIG, META, find_latest, read_meta
from tether.models.hf import DTYPES
from tether.run.safe_load import SafeLoadPlanner, SafeReader


def resolve_checkpoint(source: str | Path) -> Path:
    path = Path(source)
    if (path / META).is_file():
        return path
    found = find_latest(path)
    if found is None:
        raise FileNotFoundError(f"{source}: neither a checkpoint nor a directory holding a complete one")
    return found[0]


def export_checkpoint(source: str | Path, out_dir: str | Path) -> Path:
    path = resolve_checkpoint(source)
    meta = read_meta(path)
    model_cfg = meta["config"]["model"]
    # The checkpoint carries the model's config and tokenizer; the original directory is the fallback.
    hf_dir = path / HF_CONFIG if (path / HF_CONFIG / "config.json").is_file() else Path(model_cfg["path"])
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[model_cfg["dtype"]])
    state = model.state_dict()
    reader = SafeReader(str(path / "train"))  # fills `state` in place, without running code from the files
    reader.read_metadata()
    dcp.load({"train": {"model": state}}, storage_reader=reader, planner=SafeLoadPlanner())
    model.load_state_dict(state)
    model.tie_weights()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    return out_dir
