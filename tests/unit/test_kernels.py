"""oneDNN packed linears: same results as nn.Linear, repacked on weight updates, freed on release."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tether.engine.kernels import PackedLinear, drop_packed, onednn_available, pack_linears, packs, row_bucket

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_linear(dtype, tol, bias):
    torch.manual_seed(0)
    plain = nn.Linear(64, 48, bias=bias).to(dtype)
    packed = copy.deepcopy(plain)
    if not packs(dtype):  # bfloat16 on a CPU without AVX-512: left a plain nn.Linear, which still runs
        assert pack_linears(packed) == 0 and type(packed) is nn.Linear
        return
    assert pack_linears(packed) == 1 and isinstance(packed, PackedLinear)
    x = torch.randn(3, 5, 64, dtype=dtype)
    with torch.no_grad():
        # 3-D, strided and 2-D inputs; 15 and 9 rows run as they are, 17 and 51 padded to 18 and 52
        for inputs in (x, x[:, ::2], x.reshape(15, 64), torch.randn(17, 64, dtype=dtype),
                       torch.randn(3, 17, 64, dtype=dtype)):
            assert torch.allclose(packed(inputs).float(), plain(inputs).float(), atol=tol, rtol=tol)


def test_row_buckets_are_few_and_pad_at_most_an_eighth():
    """The shapes oneDNN builds kernels for (and caches) stay few however the batch varies."""
    rows = range(1, 65537)
    buckets = {row_bucket(n) for n in rows}
    assert len(buckets) <= 16 + 8 * 12
    assert all(n <= row_bucket(n) <= n * 9 / 8 for n in rows)
    assert [row_bucket(n) for n in (1, 16, 17, 100, 1000, 1024)] == [1, 16, 18, 104, 1024, 1024]
    assert all(row_bucket(b) == b for b in buckets)  # a bucket is its own bucket


def test_weight_update_in_place_is_repacked():
    layer = nn.Linear(16, 8)
    pack_linears(layer)
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.copy_(torch.randn(8, 16))  # how the engine loads new weights
        after = layer(x)
    assert not torch.allclose(before, after)
    assert torch.allclose(after, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_release_frees_the_packed_copy_and_resume_repacks():
    layer = nn.Linear(16, 8)
    pack_linears(layer)
    x = torch.randn(2, 16)
    with torch.no_grad():
        layer(x)
    assert layer._packed is not None
    layer.weight.data = torch.empty(0)
    drop_packed(layer)
    assert layer._packed is None
    layer.weight.data = torch.empty(8, 16)
    with torch.no_grad():
        layer.weight.copy_(torch.ones(8, 16))
        assert torch.allclose(layer(x), x.sum(-1, keepdim=True) + layer.bias, atol=1e-5)


def test_autograd_uses_the_plain_linear():
    layer = nn.Linear(16, 8)
    pack_linears(layer)
    layer(torch.randn(2, 16)).sum().backward()
    assert layer.weight.grad is not None and layer._packed is None


def test_only_cpu_float_linears_are_packed():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Embedding(5, 4))
    assert pack_linears(model) == 1
    assert type(model[0]) is PackedLinear and type(model[1]) is nn.Linear
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight"]
