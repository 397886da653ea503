"""Continuous batching on an HF model: sequences join and leave the running batch at every step.

The running batch keeps one KV cache whose rows are left-padded to a common width: row i's tokens
occupy its rightmost columns and the attention mask hides the rest, so any HF decoder with full
attention serves it unchanged. At each step:

1. new requests are prefilled; requests with the same prompt (the n samples of a GRPO group) are
   prefilled once and their cache rows copied (prefix sharing), and a prompt whose leading blocks
   were served before starts from their cached KV (prefix_cache.py); then each samples its first
   token. A row's cache may then hold padding between its cached part and the rest: the attention
   mask hides it and positions come from the sequence, not the column;
2. all running rows decode one token together, each with its own sampling settings and noise
   stream (counter-based: a row's tokens depend on its seed, not on its batch-mates);
3. finished rows leave at once (their cache rows are dropped, and columns no row uses any more
   are trimmed), freeing room for waiting requests.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Callable, cast

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tether.engine.generate import Sequence, cache_kwarg, left_pad
from tether.engine.prefix_cache import CachedPrefix, PrefixCache
from tether.engine.row_sampling import sample_rows
from tether.engine.sampling import SamplingParams


class GrowingLayer(DynamicLayer):
    """A KV-cache layer with spare room: a decode step writes its column in place.

    HF's dynamic layer concatenates on every step, copying the whole cache each time (quadratic in
    the response length); this one grows its buffer by half when full, so a step copies nothing.
    ``keys`` / ``values`` are views of the filled part; assigning them (batch edits) adopts the
    tensor as the new buffer.
    """

    # Keys and values keep their own lengths: batch edits assign them one after the other.
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._klen = self._vlen = 0

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._kbuf is None else self._kbuf[:, :, : self._klen]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._kbuf = value
        self._klen = value.shape[-2] if value is not None and value.dim() == 4 else 0

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._vbuf is None else self._vbuf[:, :, : self._vlen]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._vbuf = value
        self._vlen = value.shape[-2] if value is not None and value.dim() == 4 else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._klen == 0:
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        # _klen > 0: keys were adopted (above or by a batch edit), and values with them.
        assert self._kbuf is not None and self._vbuf is not None
        self._kbuf, self._klen = self._append(self._kbuf, self._klen, key_states)
        self._vbuf, self._vlen = self._append(self._vbuf, self._vlen, value_states)
        return self.keys, self.values

    @staticmethod
    def _append(buf: torch.Tensor, length: int, new: torch.Tensor) -> tuple[torch.Tensor, int]:
        end = length + new.shape[-2]
        if end > buf.shape[-2]:
            grown = buf.new_empty((*buf.shape[:2], end + max(16, length // 2), buf.shape[-1]))
            grown[:, :, :length] = buf[:, :, :length]
            buf = grown
        buf[:, :, length:end] = new
        return buf, end


def new_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def _layers(cache: DynamicCache) -> list[GrowingLayer]:
    # Every layer of a new_cache() is a GrowingLayer; HF types `layers` as any kind of cache layer.
    return cast("list[GrowingLayer]", cache.layers)


def _kv(layer: GrowingLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values; set in every layer of a cache the model has run on."""
    keys, values = layer.keys, layer.values
    assert keys is not None and values is not None
    return keys, values


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class RunningBatch:
    """The sequences being decoded, their shared left-padded KV cache and attention mask."""

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, T] 1 where a cache column holds a real token

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seqs: list[Sequence], cache: DynamicCache, mask: torch.Tensor) -> None:
        if not seqs:
            return
        if self.cache is None:
            self.seqs, self.cache, self.mask = list(seqs), cache, mask
            return
        assert self.mask is not None  # set together with the cache
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(_layers(self.cache), _layers(cache)):
            (my_keys, my_values), (their_keys, their_values) = _kv(mine), _kv(theirs)
            mine.keys = torch.cat([_pad_left(my_keys, width, 2), _pad_left(their_keys, width, 2)], dim=0)
            mine.values = torch.cat([_pad_left(my_values, width, 2), _pad_left(their_values, width, 2)], dim=0)
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)], dim=0)
        self.seqs.extend(seqs)

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows; then drop leading columns that no remaining row uses."""
        if not rows:
            self.seqs, self.cache, self.mask = [], None, None
            return
        # Rows to keep: the batch is not empty, so it has its cache and mask.
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(rows, dtype=torch.long)
        self.seqs = [self.seqs[r] for r in rows]
        self.mask = self.mask[index]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else 0
        self.mask = self.mask[:, start:]
        for layer in _layers(self.cache):
            keys, values = _kv(layer)
            layer.keys = keys[index, :, start:]
            layer.values = values[index, :, start:]


class ContinuousBatcher:
    """Prefill and decode steps over a RunningBatch (called by the engine core's worker thread)."""

    def __init__(self, model: nn.Module, eos_ids: set[int], pad_id: int,
                 decode: Callable[[list[int]], str] | None = None, prefix_cache: PrefixCache | None = None):
        self.model = model
        self.eos = frozenset(eos_ids)
        self.pad_id = pad_id
        self.decode = decode
        self.prefix_cache = prefix_cache
        self.batch = RunningBatch()
        self.weight_version = 0  # recorded with every sampled token (the core sets it before each step)
        self.kv = cache_kwarg(model)
        self.stats = {"prefill_tokens": 0, "prefill_tokens_shared": 0, "prefill_tokens_cached": 0,
                      "decode_steps": 0}

    def new_sequence(self, key: Any, prompt: list[int], params: SamplingParams, seed: int) -> Sequence:
        if params.stop and self.decode is None:
            raise ValueError("stop strings need a decode function")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        return Sequence(key, list(prompt), params, seed, stop_ids)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long)
        steps = torch.tensor([len(s.output_ids) for s in seqs], dtype=torch.long)
        tokens, logprobs = sample_rows(logits, [s.params for s in seqs], seeds, steps)
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.record(token, logprob, self.decode, self.weight_version)

    @torch.no_grad()
    def prefill(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill new sequences (each distinct prompt once), sample their first tokens, join the batch.

        Returns the sequences that already finished on their first token.
        """
        if not seqs:
            return []
        unique: dict[tuple[int, ...], int] = {}
        owner = [unique.setdefault(tuple(s.prompt), len(unique)) for s in seqs]
        prompts = [list(p) for p in unique]
        hits = [self.prefix_cache.lookup(p) if self.prefix_cache is not None else (None, 0)
                for p in prompts]
        ids, mask, positions, cache = self._prefill_inputs(prompts, hits)
        # logits_to_keep=1: only the last position's logits are needed (a full [B, T, vocab] is large).
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1, **{self.kv: cache}).logits[:, -1]
        computed = sum(len(p) - cached for p, (_, cached) in zip(prompts, hits))
        self.stats["prefill_tokens"] += computed
        self.stats["prefill_tokens_cached"] += sum(cached for _, cached in hits)
        self.stats["prefill_tokens_shared"] += sum(len(s.prompt) for s in seqs) - sum(len(p) for p in prompts)
        if self.prefix_cache is not None:
            for row, prompt in enumerate(prompts):
                self._remember(row, prompt, cache, mask)
        index = torch.tensor(owner, dtype=torch.long)
        if len(unique) != len(seqs):
            cache.batch_select_indices(index)  # copies of a shared prompt's cache rows: prefix sharing
        logits, mask = logits[index], mask[index]
        self._sample(logits, seqs)
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        finished = [s for s in seqs if s.finish_reason is not None]
        if live:
            if len(live) != len(seqs):
                cache.batch_select_indices(torch.tensor(live, dtype=torch.long))
                mask = mask[torch.tensor(live, dtype=torch.long)]
            self.batch.add([seqs[i] for i in live], cache, mask)
        return finished

    def _prefill_inputs(self, prompts: list[list[int]], hits: list[tuple[CachedPrefix | None, int]]):
        """input ids, attention mask, positions and a KV cache holding every prompt's cached prefix.

        Row i: [padding | its cached prefix (from the prefix cache) | padding | the rest of its prompt];
        only the rest is computed.
        """
        cached = [length for _, length in hits]
        ids, mask = left_pad([p[c:] for p, c in zip(prompts, cached)], self.pad_id)
        positions = (mask.cumsum(-1) - 1).clamp(min=0) + torch.tensor(cached)[:, None]
        cache = new_cache()
        past = max(cached)
        if past == 0:
            return ids, mask, positions, cache
        past_mask = torch.zeros((len(prompts), past), dtype=mask.dtype)
        template = next(entry for entry, _ in hits if entry is not None)
        for layer in range(len(template.keys)):
            kv_heads, _, head_dim = template.keys[layer].shape
            keys = template.keys[layer].new_zeros((len(prompts), kv_heads, past, head_dim))
            values = torch.zeros_like(keys)
            for row, (entry, length) in enumerate(hits):
                if length:
                    assert entry is not None  # a prompt with a cached prefix has its entry
                    keys[row, :, past - length:] = entry.keys[layer][:, :length]
                    values[row, :, past - length:] = entry.values[layer][:, :length]
                    past_mask[row, past - length:] = 1
            cache.update(keys, values, layer)
        return ids, torch.cat([past_mask, mask], dim=1), positions, cache

    def _remember(self, row: int, tokens: list[int], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Offer row's KV (the columns its mask marks, i.e. ``tokens``) to the prefix cache."""
        assert self.prefix_cache is not None  # the callers remember only with a prefix cache
        columns = mask[row].bool()
        kvs = [_kv(layer) for layer in _layers(cache)]
        self.prefix_cache.insert(tokens, [keys[row][:, columns] for keys, _ in kvs],
                                 [values[row][:, columns] for _, values in kvs])

    @torch.no_grad()
    def decode_step(self, abort: Collection[int] = frozenset()) -> list[Sequence]:
        """Feed every running row its pending token, sample the next one; return the rows that finished.

        Rows in ``abort`` (indices into the batch) finish with "abort" before the step runs.
        """
        b = self.batch
        # The core steps only a batch with rows in it, so it has its cache and mask.
        assert b.cache is not None and b.mask is not None
        for row in abort:
            b.seqs[row].finish_reason = "abort"
        if abort:
            done = self._drop_finished()
            if not b.seqs:
                return done
        else:
            done = []
        tokens = torch.tensor([[s.output_ids[-1]] for s in b.seqs], dtype=torch.long)
        positions = torch.tensor([[s.next_position] for s in b.seqs], dtype=torch.long)
        mask = torch.cat([b.mask, torch.ones((len(b), 1), dtype=b.mask.dtype)], dim=1)
        logits = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                            **{self.kv: b.cache}).logits[:, -1]
        b.mask = mask
        self.stats["decode_steps"] += 1
        self._sample(logits, b.seqs)
        return done + self._drop_finished()

    def _drop_finished(self) -> list[Sequence]:
        b = self.batch
        finished = [s for s in b.seqs if s.finish_reason is not None]
        if finished and self.prefix_cache is not None:
            assert b.cache is not None and b.mask is not None  # rows finished: the batch had rows
            # What a row was fed (its last token never was) may be the next turn's prefix.
            for row, seq in enumerate(b.seqs):
                if seq.finish_reason is not None:
                    self._remember(row, seq.prompt + seq.output_ids[:-1], b.cache, b.mask)
        if finished:
            b.keep([i for i, s in enumerate(b.seqs) if s.finish_reason is None])
        return finished

    def abort_all(self) -> list[Sequence]:
        for seq in self.batch.seqs:
            seq.finish_reason = "abort"
        return self._drop_finished()
