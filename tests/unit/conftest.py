"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch

from tether.tiny import build_char_tokenizer


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
