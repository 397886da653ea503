"""Runs inside vLLM's worker processes (vLLM's own Python and virtual environment): the methods the
vLLM backend calls through ``/collective_rpc`` to load the trainer's weights.

Imports only the standard library, torch and vLLM. A push arrives as buckets in POSIX shared memory
(the trainer's staging segment, or one the engine actor wrote): each bucket is copied out, because
the sender reuses the slot for the bucket after next, and the whole push is loaded at commit with
vLLM's in-place reload, which turns checkpoint-format tensors back into the kernels' layouts (on CPU
the linear layers drop their weights after pre-packing them, so a plain ``load_weights`` cannot work).
"""

from __future__ import annotations

import json
from multiprocessing import shared_memory

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _attach(name: str) -> shared_memory.SharedMemory:
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        from multiprocessing import resource_tracker

        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # the writer owns it
        return shm


class TetherWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``)."""

    def tether_load_bucket(self, spec_json: str) -> int:
        """Copy one bucket out of shared memory: ``{"segment": name, "entries": [[name, dtype, shape,
        offset], ...]}``. Returns the number of tensors held for the next commit.

        The segment stays mapped until a bucket names another one: the trainer unlinks its segment
        once every engine has mapped it, and writes the next push into the same memory."""
        spec = json.loads(spec_json)
        pending = self.__dict__.setdefault("_tether_pending", {})
        memory = self._tether_segment(spec["segment"])
        for name, dtype, shape, offset in spec["entries"]:
            dt = DTYPES[dtype]
            size = torch.Size(shape).numel() * dt.itemsize
            pending[name] = memory[offset:offset + size].view(dt).reshape(shape).clone()
        return len(pending)

    def _tether_segment(self, name: str) -> torch.Tensor:
        mapped = self.__dict__.get("_tether_mapped")
        if mapped is None or mapped[0] != name:
            if mapped is not None:
                mapped[2] = None  # the view first, then the mapping
                mapped[1].close()
            shm = _attach(name)
            self.__dict__["_tether_mapped"] = mapped = [name, shm, torch.frombuffer(shm.buf, dtype=torch.uint8)]
        return mapped[2]

    def tether_commit(self) -> int:
        """Load every tensor of the push into the model, then re-derive what was computed from the
        old weights. Returns how many tensors were loaded."""
        pending = self.__dict__.pop("_tether_pending", {})
        if not pending:
            return 0
        self.model_runner.reload_weights(weights_iterator=iter(pending.items()), is_checkpoint_format=True)
        _redispatch_tied_head(self.model_runner.get_model())
        return len(pending)

    def tether_weights_digest(self, names_json: str) -> dict:
        """{name: [sum, sum of squares]} of the named parameters as the model holds them (tests)."""
        params = dict(self.model_runner.get_model().named_parameters())
        out = {}
        for name in json.loads(names_json):
            p = params[name].detach().float()
            out[name] = [float(p.sum()), float((p * p).sum())]
        return out


def _redispatch_tied_head(model: torch.nn.Module) -> None:
    """On CPU, vLLM pre-packs the output projection's GEMM from its weight once at load. With tied
    embeddings that weight is the embedding matrix, which the reload replaced in place: the packed
    copy would still hold the old values and every logit would come from the old head."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "cpu_linear"):
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(head, remove_weight=False)
