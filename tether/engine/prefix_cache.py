"""A cross-request prefix cache: the KV cache of token sequences served earlier, reused by later ones.

It pays when requests repeat a prefix after the first one left the running batch: the turns of a
multi-turn conversation (each prompt is the last prompt + response + a new message), the samples
of one prompt that are admitted in different steps (a KV budget smaller than the group), few-shot
prompts that share their examples. Within one prefill, identical prompts are already computed once
(batcher.py); this cache covers requests that arrive later.

Sequences are matched in whole blocks of ``block_size`` tokens through a chain of block hashes (as
in vLLM's automatic prefix caching): block k's key hashes block k's tokens together with block
k-1's key, so one dict lookup per block finds the longest cached prefix, and a hit is verified
token by token. Entries hold each layer's keys and values for their full blocks; the least
recently used are evicted beyond ``max_tokens``, and an entry whose every block is also covered by
a newer entry is dropped at once (the n samples of a prompt store the prompt once).

KV values are a function of the weights: the engine core clears the cache whenever they change.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class CachedPrefix:
    tokens: tuple[int, ...]  # whole blocks only
    keys: list[torch.Tensor]  # per layer [kv_heads, len(tokens), head_dim]
    values: list[torch.Tensor]
    block_keys: list[int] = field(default_factory=list)
    live_keys: int = 0  # index entries that point here; 0: fully covered by newer entries


def block_keys(tokens: list[int] | tuple[int, ...], block_size: int, num_blocks: int) -> list[int]:
    keys, key = [], hash(())
    for b in range(num_blocks):
        key = hash((key, tuple(tokens[b * block_size : (b + 1) * block_size])))
        keys.append(key)
    return keys


class PrefixCache:
    def __init__(self, max_tokens: int, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_tokens = max_tokens
        self.block_size = block_size
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # id -> entry, least recent first
        self._index: dict[int, CachedPrefix] = {}  # block key -> newest entry holding that prefix
        self.tokens = 0
        self.stats = {"lookups": 0, "hits": 0, "hit_tokens": 0, "inserted": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[CachedPrefix | None, int]:
        """The entry holding the longest cached prefix of prompt, and that prefix's length.

        At least the prompt's last token is left to compute (its logits start the response).
        """
        self.stats["lookups"] += 1
        usable = (len(prompt) - 1) // self.block_size
        if self.max_tokens <= 0 or usable == 0 or not self._index:
            return None, 0
        keys = block_keys(prompt, self.block_size, usable)
        for b in range(usable - 1, -1, -1):
            entry = self._index.get(keys[b])
            length = (b + 1) * self.block_size
            if entry is not None and entry.tokens[:length] == tuple(prompt[:length]):
                self._entries.move_to_end(id(entry))
                self.stats["hits"] += 1
                self.stats["hit_tokens"] += length
                return entry, length
        return None, 0

    def insert(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store the KV of ``tokens`` (per layer [kv_heads, len(tokens), head_dim]); copies what it keeps."""
        blocks = len(tokens) // self.block_size
        length = blocks * self.block_size
        if self.max_tokens <= 0 or blocks == 0 or length > self.max_tokens:
            return
        chain = block_keys(tokens, self.block_size, blocks)
        if self._index.get(chain[-1]) is not None and self._index[chain[-1]].tokens[:length] == tuple(tokens[:length]):
            return  # already cached (e.g. the second sample of a prompt)
        entry = CachedPrefix(tuple(tokens[:length]), [k[:, :length].clone() for k in keys],
                             [v[:, :length].clone() for v in values], chain)
        for key in chain:
            old = self._index.get(key)
            if old is not None:
                old.live_keys -= 1
                if old.live_keys == 0:  # every block of it is in the new entry too
                    self._remove(old)
            self._index[key] = entry
        entry.live_keys = len(chain)
        self._entries[id(entry)] = entry
        self.tokens += length
        self.stats["inserted"] += 1
        while self.tokens > self.max_tokens:
            self._remove(next(iter(self._entries.values())))
            self.stats["evicted"] += 1

    def _remove(self, entry: CachedPrefix) -> None:
        self._entries.pop(id(entry))
        self.tokens -= len(entry.tokens)
        for key in entry.block_keys:
            if self._index.get(key) is entry:
                del self._index[key]
        entry.live_keys = 0

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.tokens = 0
