"""A checkpoint is loaded without running code from its files, and RNG streams continue exactly."""

from __future__ import annotations

import io
import os
import pickle
import random
import warnings

import numpy as np
import pytest
import torch

from tether.run.checkpoint import load_trainer, rng_state, save_trainer, set_rng_state
from tether.run.safe_load import UnsafeCheckpoint

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _trainer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    return model, opt, sched


def _draws() -> tuple:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()), torch.rand(2).tolist()


def test_rng_states_are_tensors_and_continue_exactly():
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.gauss(0, 1), np.random.randn()  # leave a cached gaussian in both
    state = rng_state()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    expected = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(state)
    assert _draws() == expected


def test_a_saved_trainer_loads_back_through_the_safe_reader(tmp_path):
    model, opt, sched = _trainer(0)
    random.seed(5)
    save_trainer(tmp_path, model, opt, sched, rank=0)
    expected = random.random()
    model2, opt2, sched2 = _trainer(1)
    random.seed(6)
    load_trainer(tmp_path, model2, opt2, sched2, rank=0, saved_world_size=1)
    assert torch.equal(model2.weight, model.weight)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95) and sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"]
    assert random.random() == expected


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    model, opt, sched = _trainer(0)
    save_trainer(tmp_path, model, opt, sched, rank=0)
    marker = tmp_path / "ran"
    (tmp_path / "train" / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(UnsafeCheckpoint, match="posix.system.*not loaded"):
        load_trainer(tmp_path, *_trainer(1), rank=0, saved_world_size=1)
    assert not marker.exists()


def test_a_value_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_RunsCode(str(marker)), buf)
    from tether.run.safe_load import SafeLoadPlanner

    planner = SafeLoadPlanner()

    class Item:  # the one field load_bytes reads
        class dest_index:
            fqn = "train.scheduler.last_epoch"

    buf.seek(0)
    with pytest.raises(UnsafeCheckpoint, match="train.scheduler.last_epoch"):
        planner.load_bytes(Item, buf)
    assert not marker.exists()


class _FakeCuda:
    """torch.cuda's generator calls, as a GPU process would see them (none can run here)."""

    def __init__(self, monkeypatch, state: int):
        import tether.run.checkpoint

        self.state, self.restored = torch.full((16,), state, dtype=torch.uint8), []
        monkeypatch.setattr(tether.run.checkpoint, "CUDA", self)

    def is_available(self) -> bool:
        return True

    is_initialized = is_available

    def get_rng_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.restored.append(state.clone())


@pytest.mark.parametrize("saved_on, loaded_on", [("gpu", "gpu"), ("cpu", "gpu"), ("gpu", "cpu")])
def test_the_cuda_generator_is_checkpointed_where_there_is_one(tmp_path, saved_on, loaded_on):
    with pytest.MonkeyPatch.context() as mp:
        if saved_on == "gpu":
            _FakeCuda(mp, 7)
        save_trainer(tmp_path, *_trainer(0), rank=0)
    with pytest.MonkeyPatch.context() as mp:
        cuda = _FakeCuda(mp, 9) if loaded_on == "gpu" else None
        load_trainer(tmp_path, *_trainer(1), rank=0, saved_world_size=1)
    if cuda is not None:  # restored when saved; a CPU run's checkpoint leaves CUDA's seeded stream alone
        assert [s.tolist() for s in cuda.restored] == ([[7] * 16] if saved_on == "gpu" else [])
