"""A bucket of tensors as numpy arrays of their bytes (with each tensor's name, dtype and shape): how
the object-store transport hands buckets to engine actors (Ray stores numpy arrays out of band, so the
engine gets views of its memory instead of a pickled copy). Pure: no Ray here, so engine backends that
take these buckets import without it."""

from __future__ import annotations

import warnings

import numpy as np
import torch

PackedBucket = list[tuple[str, torch.dtype, tuple[int, ...], np.ndarray]]


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> PackedBucket:
    """(name, dtype, shape, the tensor's bytes as a uint8 array); no copy for contiguous CPU tensors."""
    return [(name, t.dtype, tuple(t.shape), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            for name, t in bucket]


def unpack_bucket(packed: PackedBucket) -> dict[str, torch.Tensor]:
    """The tensors of a packed bucket, as views of its arrays (read-only shared memory from Ray: read them only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns once about non-writable arrays
        return {name: torch.from_numpy(array).view(dtype).reshape(shape) if array.size else torch.empty(shape, dtype=dtype)
                for name, dtype, shape, array in packed}
