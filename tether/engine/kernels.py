"""CPU kernels for the engine's forward pass: linear layers through oneDNN with pre-packed weights.

A decode step is a handful of [batch, hidden] x [hidden, out] products per layer, and on CPU they
are most of the step. torch's default fp32 matmul goes to MKL, which on AMD CPUs does not use its
fastest AVX-512 code; oneDNN (also inside every x86 torch build) does, and it is faster still when
a weight is reordered ("packed") into its blocked layout once instead of on every call. On the
machine docs/performance.md's numbers come from (an AMD EPYC, 2 cores) this runs the fp32 projections
of a 20M-parameter model at about 2.3x MKL's throughput.

The packed copy is a cache keyed by the weight's storage and version counter: a weight update
copies into the parameter in place (bumping its version), so the next forward repacks it, and
nothing else in the engine needs to know. Inference only: with autograd on, the layer is a plain
``nn.Linear``. The results are fp32 to rounding (different summation order than MKL), so the
engine's log-probs still match the trainer's recomputation to ~5e-7 (tested under 1e-6).

oneDNN builds a kernel per input shape and keeps it (two caches, ideep's and oneDNN's, 1024 entries
each, about 0.25 MB per entry). An engine's row counts change every step (the running batch shrinks,
prefills of any length come in), so the caches filled for hundreds of rollouts: the soak's engine grew
by 100 MB after warm-up. Rows are therefore padded up to a bucket (``row_bucket``: exact up to 16,
then 8 buckets per doubling, at most 1/8 padding), which bounds the shapes to about a hundred per
layer size; they are all met in the first few rollouts, and throughput is unchanged (bench/engine.py).
"""

from __future__ import annotations

import torch
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    """oneDNN's packed linear is in this torch build (x86 and most ARM CPU builds have it)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_PACKS: dict[torch.dtype, bool] = {}


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU: bfloat16 needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, which many AVX2-only CPUs lack (asked once, by packing a small weight)."""
    if dtype not in _PACKS:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
            _PACKS[dtype] = dtype in PACKABLE_DTYPES
        except RuntimeError:
            _PACKS[dtype] = False
    return _PACKS[dtype]


def row_bucket(rows: int) -> int:
    """The row count a packed linear runs at: ``rows`` up to 16, then rounded up to a multiple of an
    eighth of the largest power of two below it (17 -> 18, 100 -> 104, 1000 -> 1024)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


class PackedLinear(nn.Linear):
    """nn.Linear whose inference forward runs oneDNN on a packed copy of the weight.

    The parameters are the original ones (same names, same state dict); only ``forward`` differs.
    """

    _packed: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or self.weight.numel() == 0:
            return super().forward(x)
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed_key != key:  # a new weight version: pack it once
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self._packed_key = key
        rows = x.numel() // x.shape[-1]
        padded = row_bucket(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        flat = x.reshape(rows, x.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])  # rows of zeros: dropped below
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])

    def drop_packed(self) -> None:
        self._packed = self._packed_key = None


def pack_linears(model: nn.Module) -> int:
    """Switch every CPU nn.Linear of a float32/bfloat16 model to PackedLinear (bfloat16 where this CPU
    packs it); returns how many.

    Modules keep their parameters (the class is swapped in place), so weight loading by name,
    state dicts and memory release work as before.
    """
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and packs(module.weight.dtype):
            module.__class__ = PackedLinear
            count += 1
    return count


def drop_packed(model: nn.Module) -> None:
    """Free every packed weight copy (when the engine releases its weights)."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.drop_packed()
