"""Checkpoints: everything needed to continue a run, written atomically.

Layout of ``<checkpoint_dir>``::

    latest                      text file naming the newest complete checkpoint (moved last)
    rollout_000012/             state after rollout 12 finished
        meta.json               rollout id, wall time, resolved config
        train/                  torch.distributed.checkpoint (DCP) shards: model + optimizer
        rank0.pt, rank1.pt ...  LR scheduler and RNG states (python, numpy, torch) per trainer rank
        data_source.json        prompt-data position (epoch, offset, seed)

A checkpoint is written to ``rollout_000012.tmp`` and renamed only when every part is there, so a
crash mid-save leaves the previous checkpoint valid. DCP re-shards on load, so a run saved with N
trainer ranks resumes with M.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

LATEST = "latest"


def checkpoint_name(rollout_id: int) -> str:
    return f"rollout_{rollout_id:06d}"


def staging_dir(root: str | Path, rollout_id: int) -> Path:
    path = Path(root) / (checkpoint_name(rollout_id) + ".tmp")
    if path.exists():
        shutil.rmtree(path)  # left by a crash during an earlier save of the same rollout
    path.mkdir(parents=True)
    return path


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def commit(root: str | Path, rollout_id: int, config: dict) -> Path:
    """Seal a staged checkpoint: meta.json, rename into place, then move ``latest``."""
    root = Path(root)
    staged = root / (checkpoint_name(rollout_id) + ".tmp")
    (staged / "meta.json").write_text(json.dumps({"rollout_id": rollout_id, "time": time.time(), "config": config}, indent=1))
    final = root / checkpoint_name(rollout_id)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    _write_atomic(root / LATEST, final.name + "\n")
    return final


def is_complete(path: Path) -> bool:
    return (path / "meta.json").is_file() and (path / "train" / ".metadata").is_file() and (path / "data_source.json").is_file()


def find_latest(root: str | Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint under ``root`` as (path, rollout id), or None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if is_complete(path):
            return path, json.loads((path / "meta.json").read_text())["rollout_id"]
    # No usable pointer: fall back to the newest complete directory.
    for path in sorted(root.glob("rollout_*"), reverse=True):
        if path.suffix != ".tmp" and is_complete(path):
            return path, json.loads((path / "meta.json").read_text())["rollout_id"]
    return None


class ModelOptimState(Stateful):
    """Model and optimizer as one DCP Stateful (sharded state dicts, re-sharded on load)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_trainer(path: Path, model, optimizer, scheduler, rank: int) -> None:
    """Collective: every trainer rank calls it with the same staging path."""
    dcp.save({"train": ModelOptimState(model, optimizer)}, checkpoint_id=str(path / "train"))
    torch.save({"scheduler": scheduler.state_dict(), "rng": rng_state()}, path / f"rank{rank}.pt")


def load_trainer(path: Path, model, optimizer, scheduler, rank: int) -> None:
    """Collective. RNG comes from this rank's file when it exists (same world size), else rank 0's."""
    dcp.load({"train": ModelOptimState(model, optimizer)}, checkpoint_id=str(path / "train"))
    own = path / f"rank{rank}.pt"
    extra = torch.load(own if own.is_file() else path / "rank0.pt", weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])


class Checkpointer:
    """Stages and commits checkpoints under one root; the loop asks it for staging directories."""

    def __init__(self, root: str | Path, config: dict):
        self.root = Path(root)
        self.config = config

    def stage(self, rollout_id: int) -> str:
        return str(staging_dir(self.root, rollout_id))

    def commit(self, rollout_id: int) -> str:
        return str(commit(self.root, rollout_id, self.config))
