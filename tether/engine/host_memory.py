"""The C allocator's behaviour for an engine process on the host (glibc; elsewhere these do nothing).

A decode step allocates and frees the same large buffers every step: the logits, their softmax
weights, activations. At a real vocabulary they are tens of MB (128 rows x 49,152 float32 logits is
25 MB; at 151,936 it is 78 MB). glibc serves blocks that large with mmap and unmaps them when freed,
so every step faults in fresh zeroed pages again: at 128 rows and SmolLM2's vocabulary that made the
sampler 2.3x slower and the whole decode step 19% slower (bench/engine.py). ``reuse_large_blocks``
keeps such blocks in the heap, where a freed one is reused by the next step; ``trim_heap`` hands free
pages back once per weight update, so the heap does not creep up over a long run (bench/soak.py).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
LARGE_BLOCKS = 1 << 30  # blocks up to 1 GB come from the heap instead of their own mapping


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 (glibc has both)
        return libc
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return None


_LIBC = _libc()


def reuse_large_blocks() -> bool:
    """Serve large blocks from the heap and keep freed ones for reuse (process-wide); True if applied."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCKS)) and bool(_LIBC.mallopt(M_TRIM_THRESHOLD, LARGE_BLOCKS))


def trim_heap() -> None:
    """Hand the C allocator's free pages back to the system (after each weight update)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
