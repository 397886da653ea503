"""Weight buckets: the grouping by size, the object store's packed form, and the engine's load of them."""

from __future__ import annotations

import pytest
import torch

from tether.config import ConfigError, config_from_dict
from tether.engine.embedded import EmbeddedEngine, EngineError, all_finite
from tether.models.tiny import build_char_tokenizer, build_tiny_model
from tether.weight_sync.base import DEFAULT_BUCKET_BYTES, iter_buckets, nbytes
from tether.weight_sync.packed import pack_bucket, unpack_bucket


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("bucket_model"), build_char_tokenizer(), hidden_size=32,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_positions=64)
    return EmbeddedEngine(str(path), threads=1)


def test_bucket_size_is_a_cluster_field_in_mb():
    raw = {"model": {"path": "m"}}
    assert config_from_dict(raw).cluster.weight_sync_bucket_mb * 2**20 == DEFAULT_BUCKET_BYTES == 256 << 20
    assert config_from_dict({**raw, "cluster": {"weight_sync_bucket_mb": 0.5}}).cluster.weight_sync_bucket_mb == 0.5
    with pytest.raises(ConfigError, match="cluster.weight_sync_bucket_mb"):
        config_from_dict({**raw, "cluster": {"weight_sync_bucket_mb": 0}})


def test_small_buckets_split_the_weights_in_order_without_splitting_a_tensor():
    named = [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate([10, 30, 5, 100, 1, 1, 40])]
    marked = list(iter_buckets(iter(named), bucket_bytes=160))  # 40 float32 values
    assert [last for _, last in marked] == [False] * 4 + [True]
    buckets = [b for b, _ in marked]
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"]]
    assert [pair for b in buckets for pair in b] == named  # the same tensors, in order, each once
    assert all(sum(nbytes(t) for _, t in b) <= 160 for b in buckets if len(b) > 1)
    assert len(list(iter_buckets(iter(named), bucket_bytes=1 << 20))) == 1
    assert list(iter_buckets(iter([]), bucket_bytes=160)) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(iter_buckets(iter(named), 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_packed_bucket_round_trips_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {"matrix": (torch.randn(7, 5, generator=g) * 100).to(dtype), "scalar": torch.tensor(3.5).to(dtype),
               "empty": torch.zeros(0, 4, dtype=dtype),
               "strided": (torch.randn(6, 4, generator=g) * 100).to(dtype).t()}  # not contiguous
    packed = pack_bucket(list(tensors.items()))
    assert all(array.dtype.name == "uint8" for *_, array in packed)
    out = unpack_bucket(packed)
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name


def test_many_small_buckets_load_the_same_weights_into_the_engine(engine):
    state = engine.model.state_dict()
    g = torch.Generator().manual_seed(1)
    noise = {t.data_ptr(): torch.randn(t.shape, generator=g) for t in state.values()}  # tied weights: one noise
    new = {name: t + noise[t.data_ptr()] for name, t in state.items()}
    total = sum(nbytes(t) for t in new.values())
    buckets = [b for b, _ in iter_buckets(iter(new.items()), bucket_bytes=total // 8)]
    assert len(buckets) >= 8
    for bucket in buckets:
        engine.load_weight_bucket(unpack_bucket(pack_bucket(bucket)), version=3)
    assert engine.commit_weights(3) == 3
    loaded = engine.model.state_dict()
    assert all(torch.equal(loaded[name], t) for name, t in new.items())


def test_all_finite_is_exact():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(1000).to(dtype)
        assert all_finite(t)
        for bad in (float("nan"), float("inf"), float("-inf")):
            assert not all_finite(t.index_fill(0, torch.tensor([500]), bad)), (dtype, bad)
        assert not all_finite(t.index_fill(0, torch.tensor([1, 2]), float("inf")).index_fill(0, torch.tensor([3]),
                                                                                                 float("-inf")))
        # finite values whose sum overflows are not refused
        assert all_finite(torch.full((10,), torch.finfo(dtype).max, dtype=dtype))
    assert all_finite(torch.arange(5)) and all_finite(torch.zeros(0))


def test_a_non_finite_bucket_changes_nothing(engine):
    state = {name: t.clone() for name, t in engine.model.state_dict().items()}
    name = "model.layers.0.mlp.up_proj.weight"
    bad = {n: t + 1 for n, t in state.items()}
    bad[name] = bad[name].index_fill(0, torch.tensor([0]), float("nan"))
    with pytest.raises(EngineError, match="NaN/inf"):
        engine.load_weight_bucket(unpack_bucket(pack_bucket(list(bad.items()))), version=4)
    assert all(torch.equal(engine.model.state_dict()[n], t) for n, t in state.items())


def test_shared_memory_slots_carry_buckets_bit_for_bit_and_the_segment_is_removed(engine, monkeypatch):
    import os

    from tether.weight_sync import shared_memory
    from tether.weight_sync.shared_memory import SegmentReader, StagingSegment, bucket_span

    # Writer and reader share this process (in a run they do not): one registration to undo, not two.
    monkeypatch.setattr(shared_memory.resource_tracker, "unregister", lambda *args: None)

    state = engine.model.state_dict()
    g = torch.Generator().manual_seed(2)
    noise = {t.data_ptr(): torch.randn(t.shape, generator=g) for t in state.values()}
    new = {name: t + noise[t.data_ptr()] for name, t in state.items()}
    new["extra.bf16"] = torch.randn(3, generator=g).to(torch.bfloat16)  # odd sizes keep later tensors aligned
    new["extra.empty"] = torch.zeros(0, 2)
    buckets = [b for b, _ in iter_buckets(iter(new.items()), bucket_bytes=sum(nbytes(t) for t in new.values()) // 4)]
    segment = StagingSegment(max(bucket_span(b) for b in buckets))
    reader = SegmentReader()
    received = {}
    for index, bucket in enumerate(buckets):
        shared = segment.write(index % 2, bucket)
        received.update({name: t.clone() for name, t in reader.tensors(shared).items()})
    assert list(received) == list(new)
    assert all(received[n].dtype == t.dtype and torch.equal(received[n], t) for n, t in new.items())
    with pytest.raises(ValueError, match="does not fit"):
        segment.write(0, [("big", torch.zeros(segment.slot_bytes // 4 + 1))])
    path = f"/dev/shm/{segment.name.lstrip('/')}"
    if os.path.isdir("/dev/shm"):
        assert os.path.exists(path)
    segment.unlink()  # the name goes; the mapped memory stays readable
    assert not os.path.exists(path)
    assert torch.equal(reader.tensors(shared)[buckets[-1][0][0]], buckets[-1][0][1])
    reader.close()
    segment.close()


def test_a_store_master_listens_on_its_address_only():
    import os
    from datetime import timedelta

    import psutil

    from tether.weight_sync.distributed import free_port
    from tether.weight_sync.group import tcp_store

    port = free_port()
    master = tcp_store("127.0.0.1", port, 1, True, timedelta(seconds=10))
    worker = tcp_store("127.0.0.1", port, 1, False, timedelta(seconds=10))
    worker.set("k", "v")
    assert master.get("k") == b"v"
    listening = [c.laddr for c in psutil.Process(os.getpid()).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [addr.ip for addr in listening] == ["127.0.0.1"]  # torch's own store would listen on every interface
