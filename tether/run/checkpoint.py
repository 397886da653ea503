"""Checkpoints: everything needed to continue a run, written atomically.

Layout of ``<checkpoint_dir>``::

    latest                      text file naming the newest complete checkpoint (moved last)
    rollout_000012/             state after rollout 12 finished
        meta.json               rollout id, wall time, resolved config
        train/                  torch.distributed.checkpoint (DCP): model and optimizer shards (only the
                                adapters of a LoRA run: its base is model.path's), LR scheduler, RNG states (python, numpy, torch; as tensors) of every trainer
                                rank. Loaded without running code from the files (safe_load.py)
        data_source.json        where the rollout stands: the prompt-data position (epoch, offset, seed),
                                the partial-rollout buffer, the fully async stream (rollout/manager.py)
        hf_config/              the model's config and tokenizer (no weights): `tether export` needs nothing
                                else (a LoRA run's export reads its base from model.path)

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
import warnings
from pathlib import Path
from typing import Callable, cast

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from tether.errors import CheckpointSaveError
from tether.run.safe_load import SafeLoadPlanner, SafeReader

LATEST = "latest"
META = "meta.json"
HF_CONFIG = "hf_config"  # the model's config and tokenizer files, so a checkpoint exports on its own
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


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


def manifest(path: Path) -> dict[str, int]:
    """Every file of a checkpoint with its size: how a truncated or half-copied one is recognised."""
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}


def commit(root: str | Path, rollout_id: int, config: dict, extra: dict | None = None) -> Path:
    """Seal a staged checkpoint: meta.json with the manifest, rename into place, then move ``latest``."""
    root = Path(root)
    staged = root / (checkpoint_name(rollout_id) + ".tmp")
    meta = {"rollout_id": rollout_id, "time": time.time(), "config": config, **(extra or {}),
            "manifest": manifest(staged)}
    (staged / META).write_text(json.dumps(meta, indent=1))
    final = root / checkpoint_name(rollout_id)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    _write_atomic(root / LATEST, final.name + "\n")
    return final


def problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be used, or None when it is complete."""
    if not (path / META).is_file():
        return "no meta.json (the save did not finish)"
    try:
        meta = json.loads((path / META).read_text())
    except json.JSONDecodeError as err:
        return f"meta.json is not valid JSON ({err})"
    for required in ("train/.metadata", "data_source.json"):
        if not (path / required).is_file():
            return f"{required} is missing"
    for name, size in meta.get("manifest", {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    return None


def is_complete(path: Path) -> bool:
    return problem(path) is None


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def _candidates(root: Path) -> list[Path]:
    """Checkpoint directories, the one ``latest`` names first, then newest to oldest."""
    dirs = sorted((p for p in root.glob("rollout_*") if p.is_dir() and p.suffix != ".tmp"), reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in dirs:
            dirs.remove(named)
            dirs.insert(0, named)
    return dirs


def find_latest(root: str | Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint under ``root`` as (path, rollout id), or None.

    A broken one (interrupted copy, truncated shard, missing part) is skipped with a warning that
    names it and says what is wrong; the previous complete one is used.
    """
    root = Path(root)
    for path in _candidates(root):
        issue = problem(path)
        if issue is None:
            return path, read_meta(path)["rollout_id"]
        warnings.warn(f"skipping checkpoint {path}: {issue}", stacklevel=2)
    return None


def copy_hf_config(source: Path, dest: Path) -> None:
    """Copy an HF model directory without its weights (config, generation config, tokenizer)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, dest / f.name)


def prune(root: str | Path, keep_last: int, run_id: str | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints of the run ``run_id`` (of any run
    when None); returns what was removed. Another run's checkpoints and the one ``latest`` names are
    never touched."""
    root = Path(root)
    pointer = root / LATEST
    latest = pointer.read_text().strip() if pointer.is_file() else None
    ours = [p for p in sorted(root.glob("rollout_*"), reverse=True) if p.suffix != ".tmp" and is_complete(p)
            and (run_id is None or read_meta(p).get("tracker_run_id") == run_id)]
    removed = [p for p in ours[keep_last:] if p.name != latest]
    for path in removed:
        shutil.rmtree(path)
    return removed


def rng_state() -> dict[str, torch.Tensor]:
    """Python, numpy and torch RNG states as tensors (no pickle in a checkpoint; safe_load.py)."""
    version, mt, gauss = random.getstate()
    # The global generator is MT19937, whose state is the legacy tuple (numpy types it as either form).
    _, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    return {"python_mt": torch.tensor(mt, dtype=torch.int64),
            "python_gauss": torch.tensor([version, float("nan") if gauss is None else gauss], dtype=torch.float64),
            "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
            "numpy_rest": torch.tensor([pos, has_gauss, cached], dtype=torch.float64),
            "torch": torch.get_rng_state(), **_cuda_rng()}


CUDA = torch.cuda  # the generator's home, one name (tests stand a fake GPU in for it)


def _cuda_rng() -> dict[str, torch.Tensor]:
    """The current CUDA device's generator (dropout on GPU draws from it), once CUDA is in use."""
    if CUDA.is_available() and CUDA.is_initialized():
        return {"cuda": CUDA.get_rng_state()}
    return {}


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    version, gauss = state["python_gauss"].tolist()
    random.setstate((int(version), tuple(state["python_mt"].tolist()), None if gauss != gauss else gauss))
    pos, has_gauss, cached = state["numpy_rest"].tolist()
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and CUDA.is_available():  # a CPU run resumed on a GPU keeps CUDA's seeded stream
        CUDA.set_rng_state(state["cuda"])


TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
"""A checkpoint holds what trains: all of a fully fine-tuned model, a LoRA run's adapters (its frozen base
is model.path's, loaded again on resume)."""


def _loading(model: torch.nn.Module) -> StateDictOptions:
    """Non-strict with a frozen base: the frozen weights are model.path's and not in the checkpoint. What
    trains is all there: the state loaded is this model's own trained one, which DCP filled key by key."""
    return StateDictOptions(ignore_frozen_params=True, strict=not _frozen_aliases(model))


def _frozen_aliases(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]


class TrainerState(Stateful):
    """One rank's trainer state as a DCP Stateful: model and optimizer (sharded, re-sharded on load),
    LR scheduler (replicated), and this rank's RNG streams (one key per rank)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, rank: int, rng_rank: int | None,
                 with_rng: bool = True):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.rank = rank
        self.rng_rank = rng_rank  # whose RNG to restore on load; None: keep the seeded one
        self.with_rng = with_rng  # False for parts that share the rank's RNG (the critic)

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=TRAINED_ONLY)
        for name in _frozen_aliases(self.model):  # a tied head's second name escapes ignore_frozen_params
            model_sd.pop(name, None)
        state = {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}
        if self.with_rng:
            state[f"rng_rank{self.rank}"] = rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_loading(self.model))
        self.scheduler.load_state_dict(state["scheduler"])
        if self.with_rng and self.rng_rank is not None:
            set_rng_state(state[f"rng_rank{self.rng_rank}"])

    def request(self) -> dict:
        """The state dict to load into: this object's own, asking for the RNG key it restores."""
        state = self.state_dict()
        if not self.with_rng:
            return state
        del state[f"rng_rank{self.rank}"]
        if self.rng_rank is not None:  # shapes to load into (every rank's state has the same)
            state[f"rng_rank{self.rng_rank}"] = {k: torch.empty_like(v) for k, v in rng_state().items()}
        return state


def _critic_state(critic, rank: int) -> TrainerState:
    return TrainerState(critic.model, critic.optimizer, critic.scheduler, rank, None, with_rng=False)


def save_trainer(path: Path, model, optimizer, scheduler, rank: int, critic=None) -> None:
    """Collective: every trainer rank calls it with the same staging path (the critic, when there
    is one, is a second Stateful part of the same checkpoint)."""
    parts = {"train": TrainerState(model, optimizer, scheduler, rank, None)}
    if critic is not None:
        parts["critic"] = _critic_state(critic, rank)
    try:
        dcp.save(parts, checkpoint_id=str(path / "train"))
    except CheckpointException as err:  # DCP gathers every rank's failure; say what could not be written
        failures = "; ".join(f"rank {r}: {_write_failure(exc)}" for r, (exc, _) in err.failures.items())
        raise CheckpointSaveError(f"writing {path / 'train'} failed: {failures}") from None


def _write_failure(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror or exc} writing {exc.filename}"
    return f"{type(exc).__name__}: {exc}"


def load_trainer(path: Path, model, optimizer, scheduler, rank: int, saved_world_size: int, critic=None) -> None:
    """Collective. RNG streams continue exactly when the world size is unchanged; a rank that did
    not exist at save time keeps its freshly seeded RNG (nothing in training draws from it yet)."""
    parts = {"train": TrainerState(model, optimizer, scheduler, rank, rank if rank < saved_world_size else None)}
    if critic is not None:
        parts["critic"] = _critic_state(critic, rank)
    request = {name: part.request() for name, part in parts.items()}
    reader = SafeReader(str(path / "train"))
    # read_metadata refuses unsafe metadata here, with its own error rather than DCP's wrapped one.
    saved = set(reader.read_metadata().state_dict_metadata)
    for name, part in request.items():  # RNG streams the saving run did not have (CUDA's, saved on CPU)
        for key, streams in part.items():
            if key.startswith("rng_rank"):
                for stream in [s for s in streams if f"{name}.{key}.{s}" not in saved]:
                    del streams[stream]
    dcp.load(request, storage_reader=reader, planner=SafeLoadPlanner())
    for name, state in parts.items():
        state.load_state_dict(request[name])


class Checkpointer:
    """Stages, commits and prunes checkpoints under one root; the loop asks it for staging directories."""

    def __init__(self, root: str | Path, config: dict, keep_last: int | None = None,
                 extra: Callable[[], dict] | None = None, hf_source: str | None = None):
        self.root = Path(root)
        self.config = config
        self.keep_last = keep_last
        self.extra = extra or dict  # more meta.json fields, read at commit time (e.g. tracker state)
        self.hf_source = hf_source

    def stage(self, rollout_id: int) -> str:
        path = staging_dir(self.root, rollout_id)
        if self.hf_source:
            copy_hf_config(Path(self.hf_source), path / HF_CONFIG)
        return str(path)

    def abandon(self, rollout_id: int) -> str | None:
        """Remove a save that failed (its staging directory frees the space it took); the latest
        complete checkpoint, which a resume would start from, or None."""
        shutil.rmtree(self.root / (checkpoint_name(rollout_id) + ".tmp"), ignore_errors=True)
        found = find_latest(self.root)
        return str(found[0]) if found else None

    def commit(self, rollout_id: int, metrics: dict | None = None) -> str:
        """Seal the checkpoint; ``metrics`` (the rollout's metrics row) is kept in meta.json."""
        extra = self.extra()
        path = commit(self.root, rollout_id, self.config, {**extra, "metrics_row": metrics})
        if self.keep_last:
            prune(self.root, self.keep_last, extra.get("tracker_run_id"))
        return str(path)
