"""The weight-update group: a member built the way SGLang builds its side (a tcp:// rendezvous, the
store under PrefixStore(group_name), torch's process-group helper) and tether's join_group meet in one
group; joins one at a time, refused in bounded time, with the group named."""

from __future__ import annotations

import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta

import pytest
import torch

from tether.weight_sync.distributed import free_port
from tether.weight_sync.group import GroupJoiner, JoinBusy, JoinFailed, Receiver, join_group, leave_group


def sglang_style_member(port: int, name: str) -> list[float]:
    """Rank 1 joined as SGLang's /init_weights_update_group does, then a broadcast from rank 0."""
    import torch.distributed.distributed_c10d as c10d

    timeout = timedelta(seconds=30)
    store, rank, world = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend("gloo"), c10d.PrefixStore(name, store),
                                              group_name=name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {0: 0, 1: 1}
    received = torch.zeros(4)
    torch.distributed.broadcast(received, src=0, group=group)
    return received.tolist()


def test_a_member_built_as_sglang_builds_it_joins_our_group():
    port, name = free_port(), "tether-weights-test"
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as other:
        received = other.submit(sglang_style_member, port, name)
        group = join_group("127.0.0.1", port, 0, 2, "gloo", 30, name)
        group.broadcast(torch.arange(4.0), 0).wait()
        assert received.result(timeout=60) == [0.0, 1.0, 2.0, 3.0]
    leave_group(group)
    # The name is free again: a later sender may use it (a process holds one group per name).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as other:
        port = free_port()
        received = other.submit(sglang_style_member, port, name)
        receiver = Receiver(join_group("127.0.0.1", port, 0, 2, "gloo", 30, name), "cpu")
        receiver.group.broadcast(torch.full((4,), 7.0), 0).wait()
        assert received.result(timeout=60) == [7.0] * 4
        receiver.close()


def test_a_join_is_refused_in_bounded_time_naming_the_group_and_one_at_a_time():
    joiner = GroupJoiner(timeout_s=1.0)
    entered, release = threading.Event(), threading.Event()

    def slow(*args):
        entered.set()
        release.wait(10)

    worker = threading.Thread(target=joiner.join, args=("127.0.0.1", 1, 1, 2, "gloo", "g", slow))
    worker.start()
    entered.wait(5)
    with pytest.raises(JoinBusy):
        joiner.join("127.0.0.1", 1, 1, 2, "gloo", "g")
    release.set()
    worker.join()
    start = time.monotonic()
    with pytest.raises(JoinFailed, match="'tether-weights-9' at 127.0.0.1:.* as rank 1 of 2 failed within 1s"):
        joiner.join("127.0.0.1", free_port(), 1, 2, "gloo", "tether-weights-9")  # nobody hosts it
    assert time.monotonic() - start < 10


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="gloo.*nccl.*'mpi'"):
        join_group("127.0.0.1", free_port(), 0, 2, "mpi", 1, "g")
