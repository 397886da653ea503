"""The cross-request prefix cache: block matching, eviction, and outputs equal to computing afresh."""

from __future__ import annotations

import pytest
import torch

from tether.trainer.batch import TrainBatch
from tether.engine.batcher import ContinuousBatcher
from tether.engine.prefix_cache import PrefixCache
from tether.engine.sampling import SamplingParams
from tether.trainer.step import StepSettings, response_logprobs


def kv(n: int, fill: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two layers of [kv_heads=2, n, head_dim=3] keys/values whose column j holds fill + j."""
    col = (torch.arange(n, dtype=torch.float32) + fill)[None, :, None].expand(2, n, 3).clone()
    return [col, col + 100], [col + 0.5, col + 100.5]


def test_longest_whole_block_prefix_is_found_and_verified():
    cache = PrefixCache(max_tokens=1000, block_size=4)
    tokens = list(range(10, 20))  # 10 tokens: 2 whole blocks are kept
    cache.insert(tokens, *kv(10))
    assert cache.tokens == 8
    entry, length = cache.lookup(tokens[:9] + [99, 98])  # shares 9 tokens: 2 blocks
    assert length == 8 and entry.tokens == tuple(tokens[:8])
    assert torch.equal(entry.keys[1][:, :length], kv(10)[0][1][:, :8])
    assert cache.lookup(tokens[:8]) == (cache.lookup(tokens[:8])[0], 4)  # the last token is always computed
    assert cache.lookup([10, 11, 12, 0, 14, 15, 16, 17, 18]) == (None, 0)  # differs inside block 1
    assert cache.lookup([1, 2, 3]) == (None, 0)
    assert cache.stats["hits"] == 3 and cache.stats["lookups"] == 5


def test_superseded_entries_are_dropped_and_lru_evicts():
    cache = PrefixCache(max_tokens=16, block_size=4)
    cache.insert([1, 2, 3, 4], *kv(4))
    cache.insert([1, 2, 3, 4], *kv(4))  # the same prefix again: stored once
    assert len(cache) == 1
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], *kv(8))  # covers every block of the first: it goes
    assert len(cache) == 1 and cache.tokens == 8
    cache.insert([9, 9, 9, 9, 9, 9, 9, 9], *kv(8))
    cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0])  # touch the first: the second is now least recent
    cache.insert([7, 7, 7, 7], *kv(4))  # 20 tokens > 16: evict the least recently used
    assert cache.lookup([9, 9, 9, 9, 9]) == (None, 0)
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0])[1] == 8 and cache.tokens == 12
    assert cache.stats["evicted"] == 1
    cache.clear()
    assert len(cache) == 0 and cache.lookup([1, 2, 3, 4, 5]) == (None, 0)


def test_a_zero_budget_disables_it():
    cache = PrefixCache(max_tokens=0, block_size=4)
    cache.insert([1, 2, 3, 4, 5], *kv(5))
    assert len(cache) == 0 and cache.lookup([1, 2, 3, 4, 5, 6]) == (None, 0)


@pytest.fixture(scope="module")
def model(small_model):
    return small_model


def serve(batcher: ContinuousBatcher, requests: list[tuple[list[int], SamplingParams, int]]) -> list:
    seqs = [batcher.new_sequence(i, p, sp, seed) for i, (p, sp, seed) in enumerate(requests)]
    done = {s.key: s for s in batcher.prefill(seqs)}
    while len(batcher.batch):
        done.update({s.key: s for s in batcher.decode_step()})
    return [done[i] for i in range(len(requests))]


def test_a_second_turn_reuses_the_first_and_matches_computing_afresh(model):
    """Turn 2's prompt = turn 1's prompt + response + more: its prefix comes from the cache."""
    params = SamplingParams(temperature=0.9, max_new_tokens=12, ignore_eos=True)
    system = list(range(5, 25))
    first = [(system + [30 + i, 31], params, i) for i in range(3)]
    cached = ContinuousBatcher(model, {1}, 0, prefix_cache=PrefixCache(4096, block_size=4))
    turn1 = serve(cached, first)
    assert cached.stats["prefill_tokens_cached"] == 0 and cached.stats["prefill_tokens"] == 3 * 22
    second = [(s.prompt + s.output_ids + [40, 41, 42], params, 10 + i) for i, s in enumerate(turn1)]
    # a new conversation with the same system prompt, and one that shares nothing
    second += [(system + [50, 51, 52], params, 20), ([60, 61, 62, 63, 64, 65], params, 21)]
    turn2 = serve(cached, second)
    fresh = serve(ContinuousBatcher(model, {1}, 0), second)
    # 3 x 32 tokens of the first turns (their whole blocks) + 20 of the system prompt came from cache
    assert cached.stats["prefill_tokens_cached"] == 3 * 32 + 20
    for got, ref in zip(turn2, fresh):
        assert got.output_ids == ref.output_ids
        assert max(abs(a - b) for a, b in zip(got.output_logprobs, ref.output_logprobs)) < 1e-5
    # and on-policy exactness holds for the rows that started from cached KV
    batch = TrainBatch(tokens=[s.prompt + s.output_ids for s in turn2], prompt_lengths=[len(s.prompt) for s in turn2],
                       response_lengths=[len(s.output_ids) for s in turn2], temperature=0.9)
    settings = StepSettings(micro_batch_size=5, global_batch_size=5, pad_id=0, grad_clip=0.0, policy_loss="ppo_clip",
                            loss_params=None, advantage_estimator="grpo")
    trainer = response_logprobs(model, batch, [list(range(5))], settings)
    diffs = torch.cat([(trainer[i] - torch.tensor(s.output_logprobs)).abs() for i, s in enumerate(turn2)])
    assert float(diffs.mean()) < 1e-6
