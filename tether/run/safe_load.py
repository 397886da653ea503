"""Loading a torch.distributed.checkpoint (DCP) without running code from it.

DCP's reader unpickles the checkpoint's ``.metadata`` file and every non-tensor value (optimizer
hyper-parameters, the LR scheduler's counters) with full pickle, so loading a checkpoint someone
else wrote could run anything. Here the metadata is unpickled with an allow-list of the classes DCP
writes there (its own metadata dataclasses, torch dtypes and sizes, paths), and non-tensor values
with ``torch.load(weights_only=True)`` (plain containers, numbers, strings, tensors). tether's own
checkpoints hold nothing else: RNG states are saved as tensors (checkpoint.rng_state).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
            ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
            ("collections", "OrderedDict")}


class UnsafeCheckpoint(RuntimeError):
    """The checkpoint holds an object outside what a checkpoint may contain; nothing was loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED or is_dtype:
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{self.path} refers to {module}.{name}, which checkpoint metadata never holds; "
                               "not loaded (unpickling it could run code)")


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled with the allow-list above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        storage = getattr(metadata, "storage_meta", None)  # may be missing, or None
        if storage is None:
            storage = metadata.storage_meta = StorageMeta()
        storage.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with ``weights_only=True`` (the rest as its parent)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(f"value {fqn} of the checkpoint is not plain data; not loaded: {err}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
