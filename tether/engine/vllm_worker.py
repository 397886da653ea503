"""Runs inside vLLM's worker processes (vLLM's own Python and virtual environment): the methods the
vLLM backend calls through ``/collective_rpc`` to load the trainer's weights.

Imports only the standard library, torch, vLLM and tether's torch-only group module. A push arrives
one of two ways, and either way vLLM's in-place reload turns the checkpoint-format tensors back into
the kernels' layouts (on CPU the linear layers drop their weights after pre-packing them, so a plain
``load_weights`` cannot work):

* as buckets in POSIX shared memory (the trainer's staging segment, or one the engine actor wrote):
  each bucket is copied out, because the sender reuses the slot for the bucket after next, and the
  whole push is loaded at commit;
* over the weight-update group (the distributed transport): every worker joins the trainer's group
  itself, as rank_offset + its tensor-parallel rank, and receives each broadcast tensor straight into
  its own device's memory (NCCL GPU to GPU, gloo on CPU). It is loaded at once, layer by layer, as
  vLLM's own NCCL weight transfer does (begin on the first bucket, finish at commit), so a push never
  sits in the worker twice.
"""

from __future__ import annotations

import json
from typing import Any
from multiprocessing import shared_memory

import torch

from tether.weight_sync.group import DTYPES, join_group, leave_group

# A LoRA run's pushes to an engine serving the policy as a LoRA are the adapters, under PEFT's names
# (tether/models/lora.py, which this process does not import): kept aside, saved as an adapter folder.
ADAPTER_PREFIX = "base_model.model."


def _attach(name: str) -> shared_memory.SharedMemory:
    try:
        # track= is Python >= 3.13 (type-checked as 3.10); older ones raise TypeError, handled below.
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:
        from multiprocessing import resource_tracker

        shm = shared_memory.SharedMemory(name=name)
        # the writer owns it; _name (with its leading "/") is what attaching registered, not in typeshed
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm


class TetherWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``)."""

    # Set by the vLLM worker this class is mixed into; declared for the type checker, which has no vLLM.
    rank: int
    model_runner: Any

    def tether_load_bucket(self, spec_json: str) -> int:
        """Copy one bucket out of shared memory: ``{"segment": name, "entries": [[name, dtype, shape,
        offset], ...]}``. Returns the number of tensors held for the next commit.

        The segment stays mapped until a bucket names another one: the trainer unlinks its segment
        once every engine has mapped it, and writes the next push into the same memory."""
        spec = json.loads(spec_json)
        pending = self.__dict__.setdefault("_tether_pending", {})
        adapter = self.__dict__.setdefault("_tether_adapter", {})
        memory = self._tether_segment(spec["segment"])
        for name, dtype, shape, offset in spec["entries"]:
            dt = DTYPES[dtype]
            size = torch.Size(shape).numel() * dt.itemsize
            held = adapter if name.startswith(ADAPTER_PREFIX) else pending
            held[name] = memory[offset:offset + size].view(dt).reshape(shape).clone()
        return len(pending) + len(adapter)

    def _tether_segment(self, name: str) -> torch.Tensor:
        mapped = self.__dict__.get("_tether_mapped")
        if mapped is None or mapped[0] != name:
            if mapped is not None:
                mapped[2] = None  # the view first, then the mapping
                mapped[1].close()
            shm = _attach(name)
            self.__dict__["_tether_mapped"] = mapped = [name, shm, torch.frombuffer(shm.buf, dtype=torch.uint8)]
        return mapped[2]

    def tether_join_group(self, spec_json: str) -> int:
        """Join the trainer's weight-update group: ``{"master_address", "master_port", "rank_offset",
        "world_size", "backend", "timeout_s", "group_name"}``. Returns this worker's rank in it."""
        spec = json.loads(spec_json)
        old = self.__dict__.pop("_tether_group", None)
        if old is not None:
            leave_group(old)
        rank = spec["rank_offset"] + self.rank
        self.__dict__["_tether_group"] = join_group(spec["master_address"], spec["master_port"], rank,
                                                    spec["world_size"], spec["backend"], spec["timeout_s"],
                                                    spec["group_name"])
        return rank

    def tether_receive_bucket(self, spec_json: str) -> int:
        """Receive one announced bucket ``{"names", "dtypes", "shapes"}`` from rank 0 and load it;
        returns how many tensors this push has loaded so far."""
        spec = json.loads(spec_json)
        group = self.__dict__.get("_tether_group")
        if group is None:
            raise RuntimeError("no weight-update group: /init_weights_update_group first")
        model = self.model_runner.get_model()
        adapter = self.__dict__.setdefault("_tether_adapter", {})
        device = getattr(self, "device", None) or torch.device("cpu")
        for name, dtype, shape in zip(spec["names"], spec["dtypes"], spec["shapes"]):
            # A tensor of its own each: the reload keeps a layer's tensors until the layer is complete.
            tensor = torch.empty(shape, dtype=DTYPES[dtype], device=device)
            group.broadcast(tensor, 0).wait()
            if name.startswith(ADAPTER_PREFIX):
                adapter[name] = tensor.cpu()
                continue
            if "_tether_streamed" not in self.__dict__:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(model)
                self.__dict__["_tether_streamed"] = 0
            model.load_weights([(name, tensor)])
            self.__dict__["_tether_streamed"] += 1
        return self.__dict__.get("_tether_streamed", 0) + len(adapter)

    def tether_save_adapter(self, folder: str) -> int:
        """Write the adapters this push delivered as ``folder``/adapter_model.safetensors (the first
        worker writes; every worker received them); returns how many tensors there were."""
        adapter = self.__dict__.pop("_tether_adapter", {})
        if adapter and self.rank == 0:
            from pathlib import Path

            from safetensors.torch import save_file

            Path(folder).mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in adapter.items()}, f"{folder}/adapter_model.safetensors",
                      metadata={"format": "pt"})
        return len(adapter)

    def tether_commit(self) -> int:
        """Finish the push: load what shared memory delivered, or end the reload the broadcast began;
        then re-derive what was computed from the old weights. Returns how many tensors were loaded."""
        runner = self.model_runner
        streamed = self.__dict__.pop("_tether_streamed", None)
        pending = self.__dict__.pop("_tether_pending", {})
        if streamed is not None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
            runner.reset_lora_state()
            runner.reset_encoder_cache()
            runner.reset_mm_cache()
        elif pending:
            runner.reload_weights(weights_iterator=iter(pending.items()), is_checkpoint_format=True)
        else:
            return 0
        _redispatch_tied_head(runner.get_model())
        return len(pending) if streamed is None else streamed

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
