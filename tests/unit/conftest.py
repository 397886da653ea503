"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch

from tether.models.tiny import build_char_tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models here are tiny: extra intra-op threads only add synchronisation (and are slow on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A 2-layer Qwen2 (hidden 32, GQA 4/2 heads) in float32, eval mode: for engine/trainer checks."""
    from tether.models.tiny import build_tiny_model
    from tether.models.hf import load_model

    path = build_tiny_model(tmp_path_factory.mktemp("small_model"), build_char_tokenizer(), hidden_size=32,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_positions=256)
    return load_model(str(path), "float32").eval()
