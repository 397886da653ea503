"""Weight buckets through one shared-memory segment that lives as long as the sender: engines on the trainer's host.

Ray's object store places every bucket in freshly allocated memory, and each process that touches
fresh pages pays a page fault per 4 KiB: on a 2-core machine that kernel time was larger than the
copy itself. A segment kept from push to push is faulted in once (per process), so from the second
push on a bucket costs one copy into the segment (trainer) and one copy out of it (each engine).
It has two slots: the trainer fills one while the engines load the other. The segment grows when a
bucket does not fit, so it is about two buckets (the model, if that is smaller: an untouched slot
takes no memory). Its name is removed at the end of the push that created it, when the engines
have it mapped, so the memory goes with the last process using it, even one killed.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

from tether.weight_sync.base import copy_threads, nbytes

ALIGN = 64  # every tensor starts on a cache line


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bucket_span(bucket: list[tuple[str, torch.Tensor]]) -> int:
    """Bytes a bucket takes in a slot."""
    return sum(_aligned(nbytes(t)) for _, t in bucket)


@dataclass(frozen=True)
class SharedBucket:
    """Where a bucket's tensors lie in a segment: (name, dtype, shape, byte offset) each."""

    segment: str
    entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]


def shared_memory_room(path: str = "/dev/shm") -> int | None:
    """Free bytes of the shared-memory filesystem, or None where there is none to ask (not Linux)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class StagingSegment:
    """Trainer side: a segment of two slots of ``slot_bytes``, written bucket by bucket."""

    def __init__(self, slot_bytes: int):
        room = shared_memory_room()
        if room is not None and room < 2 * slot_bytes:
            # Writing past the room of /dev/shm kills the process (SIGBUS): refuse up front.
            raise MemoryError(f"/dev/shm has {room / 2**20:.0f} MB free, a weight-sync segment needs "
                              f"{2 * slot_bytes / 2**20:.0f} MB")
        self.slot_bytes = slot_bytes = max(_aligned(slot_bytes), ALIGN)
        self.shm = SharedMemory(create=True, size=2 * slot_bytes)
        self.name = self.shm.name
        self.memory: torch.Tensor | None = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        self._state = [False]  # unlinked; shared with the finalizer
        self._finalizer = weakref.finalize(self, _remove, self.shm, self._state)

    def write(self, slot: int, bucket: list[tuple[str, torch.Tensor]], overlapped: bool = False) -> SharedBucket:
        """Copy the bucket into a slot (with half the threads when ``overlapped``: engines load meanwhile)."""
        assert self.memory is not None, "the segment is closed"
        offset = slot * self.slot_bytes
        if bucket_span(bucket) > self.slot_bytes:
            raise ValueError(f"a bucket of {bucket_span(bucket)} bytes does not fit a slot of {self.slot_bytes}")
        entries = []
        with copy_threads(overlapped):
            for name, tensor in bucket:
                size = nbytes(tensor)
                if size:
                    src = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                    self.memory[offset : offset + size].copy_(src)
                entries.append((name, tensor.dtype, tuple(tensor.shape), offset))
                offset += _aligned(size)
        return SharedBucket(self.name, entries)

    def unlink(self) -> None:
        """Remove the segment's name once every engine has it mapped: the memory stays while it is
        mapped and goes with the last process, so a killed trainer leaves nothing behind."""
        if not self._state[0]:
            self._state[0] = True
            self.shm.unlink()

    def close(self) -> None:
        self.memory = None
        self._finalizer()


def _remove(segment_shm: SharedMemory, unlinked: list[bool]) -> None:
    if not unlinked[0]:
        segment_shm.unlink()
    _close(segment_shm)


def _close(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a tensor still views it: it is unmapped when that view goes
        pass


class SegmentReader:
    """Engine side: the segment a sender writes to, attached once and kept while the sender uses it."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.shm: SharedMemory | None = None
        self.memory: torch.Tensor | None = None

    def tensors(self, bucket: SharedBucket) -> dict[str, torch.Tensor]:
        """The bucket's tensors as views of the segment: valid until the sender writes that slot again."""
        if bucket.segment != self.name:  # the first bucket, or the sender grew its segment
            self.close()
            self.shm, self.name = _attach(bucket.segment), bucket.segment
            self.memory = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        assert self.memory is not None  # attached above, or for an earlier bucket of this segment
        out = {}
        for name, dtype, shape, offset in bucket.entries:
            size = torch.Size(shape).numel() * dtype.itemsize
            out[name] = self.memory[offset : offset + size].view(dtype).reshape(shape) if size else \
                torch.empty(shape, dtype=dtype)
        return out

    def close(self) -> None:
        if self.shm is not None:
            self.memory = None
            _close(self.shm)
            self.shm = self.name = None


def _attach(name: str) -> SharedMemory:
    try:
        # track= is Python >= 3.13 (type-checked as 3.10); older ones raise TypeError, handled below.
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:
        shm = SharedMemory(name=name)
        # Before 3.13 attaching registers the segment for removal when this process exits; it is
        # the sender's to remove.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm
