"""The embedded engine: the policy's HF model served from a Ray actor with a KV cache.

It runs wherever torch runs (a laptop CPU, one GPU), and it is the reference the other backends
are held to: in float32 its log-probs equal the trainer's recomputation.
"""

from __future__ import annotations

import time

import torch

from tether.engine.base import KV_CACHE, WEIGHTS, Engine, check_tags
from tether.engine.kernels import drop_packed, onednn_available, pack_linears
from tether.models.hf import load_model, load_tokenizer


class EngineError(RuntimeError):
    pass


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in a float tensor. The sum is non-finite whenever an element is (inf and NaN never
    add up to a finite number) and costs one read, a fraction of ``isfinite(t).all()``; only a sum that
    overflows from finite values needs the element-wise check."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    total = tensor.sum(dtype=torch.float32 if tensor.element_size() < 4 else None)  # no fp16/bf16 overflow
    return bool(torch.isfinite(total)) or bool(torch.isfinite(tensor).all())


class EmbeddedEngine(Engine):
    def __init__(self, model_path: str, dtype: str = "float32", max_batch: int = 256, threads: int = 0,
                 device: str = "cpu", deterministic: bool = False, onednn_linear: bool = True):
        if threads:
            torch.set_num_threads(threads)
        if deterministic:
            torch.use_deterministic_algorithms(True)
        self.model = load_model(model_path, dtype, device).eval()
        # CPU decode is mostly linear layers: run them through oneDNN with packed weights (kernels.py).
        self.packed_linears = pack_linears(self.model) if onednn_linear and onednn_available() else 0
        self.tokenizer = tokenizer = load_tokenizer(model_path)
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.max_batch = max_batch
        self.device = device
        self.weight_version = 0
        self.weights_changed = 0  # bumped by every change of the weights' values (caches of KV watch it)
        self.released: set[str] = set()
        self._shapes = {name: (p.shape, p.dtype) for name, p in self.model.named_parameters()}
        self._pending: set[str] = set()

    @property
    def pending_weights(self) -> int:
        """Parameters reallocated by resume_memory but not yet loaded again."""
        return len(self._pending)

    # ------------------------------------------------------------ weights
    def load_weight_bucket(self, tensors: dict[str, torch.Tensor], version: int) -> int:
        # Tied weights (lm_head = embed_tokens) appear under both names in a state dict.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers())
        targets = {}
        # Every tensor of the bucket is checked before any is copied: a refused update changes nothing.
        for name, tensor in tensors.items():
            target = params.get(name, buffers.get(name))
            if target is None:
                raise EngineError(f"weight update version {version}: unknown tensor {name!r}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise EngineError(f"weight update version {version}: {name} has shape {tuple(tensor.shape)}, "
                                  f"model expects {tuple(target.shape)}")
            if tensor.dtype != target.dtype:
                raise EngineError(f"weight update version {version}: {name} is {tensor.dtype}, the engine's "
                                  f"weights are {target.dtype} (send the model's dtype)")
            if not all_finite(tensor):
                raise EngineError(f"weight update version {version}: {name} has NaN/inf values; refused")
            targets[name] = target
        for name, tensor in tensors.items():
            with torch.no_grad():
                targets[name].copy_(tensor)
            self._pending.discard(name)
        self.weights_changed += 1
        return len(tensors)

    def commit_weights(self, version: int) -> int:
        if self._pending:
            missing = sorted(self._pending)[:5]
            raise EngineError(f"weight version {version} committed while {len(self._pending)} released tensors "
                              f"were never loaded, e.g. {missing}")
        self.weight_version = version
        return version

    @torch.no_grad()
    def prompt_logprobs(self, prompts: list[list[int]], temperatures: list[float],
                        max_logits: int = 1 << 27) -> list[list[float | None]]:
        """Each prompt token's log-prob after the tokens before it (None for the first): what a teacher
        or a reward model scores. Prompts go through the model in right-padded batches whose logits stay
        under ``max_logits`` values (512 MB of float32); at temperature t > 0 the logits are divided by it
        first, as when sampling (0 means 1: greedy has no distribution of its own)."""
        if self.released:
            raise EngineError(f"cannot score prompts while {sorted(self.released)} are released")
        vocab = self.model.get_output_embeddings().weight.shape[0]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
        out: list[list[float | None]] = [[] for _ in prompts]
        start = 0
        while start < len(order):
            longest = len(prompts[order[start]])
            end = start + 1
            while end < len(order) and (end - start + 1) * max(longest, len(prompts[order[end]])) * vocab <= max_logits:
                longest = max(longest, len(prompts[order[end]]))
                end += 1
            for i, values in zip(order[start:end], self._score_batch([prompts[i] for i in order[start:end]],
                                                                     [temperatures[i] for i in order[start:end]])):
                out[i] = values
            start = end
        return out

    def _score_batch(self, prompts: list[list[int]], temperatures: list[float]) -> list[list[float | None]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=self.device)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.tensor(p, device=self.device)
            mask[row, : len(p)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=self.device)[:, None, None]
        logits = logits / scale
        chosen = logits.gather(-1, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, -1)
        return [[None, *chosen[row, : len(p) - 1].tolist()] for row, p in enumerate(prompts)]

    # ------------------------------------------------------------ memory
    def release_memory(self, tags: list[str]) -> None:
        self.weights_changed += 1
        for tag in check_tags(tags):
            if tag == WEIGHTS and WEIGHTS not in self.released:
                # Shrink every parameter's storage to nothing; shapes are kept to reallocate on resume.
                for p in self.model.parameters():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                drop_packed(self.model)  # the packed copies are weights too
            # The KV cache belongs to the serving core (its running batch and prefix cache, which
            # EngineCore.release_memory drops); the tag is tracked here so the core refuses new requests.
            self.released.add(tag)

    def resume_memory(self, tags: list[str]) -> None:
        for tag in check_tags(tags):
            if tag == WEIGHTS and WEIGHTS in self.released:
                for name, p in self.model.named_parameters():
                    shape, dtype = self._shapes[name]
                    p.data = torch.empty(shape, dtype=dtype, device=self.device)
                self._pending = set(self._shapes)
            self.released.discard(tag)

    def health(self) -> dict:
        return {"ok": True, "weight_version": self.weight_version, "released": sorted(self.released),
                "time": time.time(), "kv_cache": KV_CACHE not in self.released}
