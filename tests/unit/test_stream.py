"""tether.rollout.stream.RolloutStream against a fake fleet: an engine in-process whose tokens take a
few event-loop steps each, that holds requests while paused, aborts by rid and samples every token
under the weight version it has at that moment. Trains are simulated by the test between takes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from tether.engine.sampling import SamplingParams
from tether.rollout.data_source import DataSource, PromptRow
from tether.rollout.stream import RolloutStream, StreamSettings, StreamTimeout, staleness_metrics

P = 4  # groups per take
ROWS = 12  # three takes per epoch


class FakeRouter:
    def __init__(self, fleet: FakeFleet):
        self.fleet = fleet

    def broadcast(self, path: str, payload: dict | None = None) -> list[dict]:
        self.fleet.calls.append(path)
        if path == "/pause_generation":
            self.fleet.held.set()
        elif path == "/continue_generation":
            self.fleet.held.clear()
        return [{"success": True}]


class FakeFleet:
    """``tokens(prompt_index, attempt)``: how long a response is; each token takes ``step_s``."""

    def __init__(self, tokens=lambda prompt, attempt: 3, step_s: float = 0.002):
        self.tokens, self.step_s = tokens, step_s
        self.version = 0
        self.held = threading.Event()
        self.aborted: set[str] = set()
        self.active: set[str] = set()
        self.abort_count = 0
        self.calls: list[str] = []
        self.requests = 0
        self.router = FakeRouter(self)

    async def generate(self, client, samples, params, seeds, rids, what):
        todo = [(s, rid) for s, rid in zip(samples, rids) if s.status in ("pending", "aborted")]
        self.requests += 1
        await asyncio.gather(*(self._one(s, rid) for s, rid in todo))

    async def _one(self, sample, rid):
        self.active.add(rid)
        try:
            await self._decode(sample, rid)
        finally:
            self.active.discard(rid)
            self.aborted.discard(rid)

    async def _decode(self, sample, rid):
        attempt = int(rid.split("-")[2])
        want = self.tokens(sample.prompt_index, attempt) - sample.response_length
        spans: list[list[int]] = []
        for _ in range(want):
            while self.held.is_set() and rid not in self.aborted:
                await asyncio.sleep(0.001)
            if rid in self.aborted:
                break
            await asyncio.sleep(self.step_s)
            if spans and spans[-1][0] == self.version:
                spans[-1][1] += 1
            else:
                spans.append([self.version, 1])
        n = sum(c for _, c in spans)
        finish = "abort" if rid in self.aborted and n < want else "stop"
        sample.add_reply([7] * n, [-0.5] * n, "x" * n, finish, self.version, spans)

    async def abort(self, client, rids):
        """Like an engine: only requests it is running are aborted."""
        hit = self.active & set(rids)
        self.aborted |= hit
        self.abort_count += len(hit)
        return len(hit)


def rows(n: int = ROWS) -> list[PromptRow]:
    return [PromptRow(index=i, line=i + 1, prompt=f"p{i}", label=None, metadata={}, prompt_ids=[1, 2 + i])
            for i in range(n)]


async def score(group):
    for s in group:
        s.reward = float(s.prompt_index % 2)


def make_stream(fleet: FakeFleet, k: int, *, stale="retry", mode="in_place", keep=None, timeout_s=20.0,
                max_in_flight=None, groups_per_request=1, over_sampling=P) -> RolloutStream:
    data = DataSource(rows(), prompts_per_rollout=P, n_samples_per_prompt=2, shuffle=True, seed=3)
    settings = StreamSettings(need=P, max_staleness=k, start_per_take=over_sampling, max_in_flight=max_in_flight,
                              stale_groups=stale,
                              groups_per_request=groups_per_request, pause_mode=mode, seed=1, timeout_s=timeout_s)
    return RolloutStream(fleet, data, SamplingParams(max_new_tokens=64), settings, score,
                         keep or (lambda group: (True, "")))


def run_steps(stream: RolloutStream, fleet: FakeFleet, start: int, stop: int, train_s: float = 0.01):
    """Takes start..stop-1 with a simulated train step and a weight push after each; returns
    {rollout_id: (flights, metrics)}."""
    out = {}
    for r in range(start, stop):
        flights, metrics = stream.take(r)
        out[r] = (flights, metrics)
        time.sleep(train_s)
        stream.pause()
        fleet.version = r + 1  # the push
        stream.resume(r + 1)
    return out


def trained_prompts(taken: dict) -> Counter:
    """How often each (epoch, prompt) was trained on."""
    return Counter((f.epoch, f.samples[0].prompt_index) for flights, _ in taken.values() for f in flights)


def assert_once_each(taken: dict, epochs: int, missing: set = frozenset()) -> None:
    """No prompt trained twice in an epoch, and the first ``epochs`` epochs complete (but ``missing``)."""
    trained = trained_prompts(taken)
    assert max(trained.values()) == 1, [key for key, n in trained.items() if n > 1]
    for epoch in range(epochs):
        assert {p for e, p in trained if e == epoch} == set(range(ROWS)) - missing, epoch


def first_prompt() -> int:
    return int(DataSource(rows(), prompts_per_rollout=P, n_samples_per_prompt=2, shuffle=True, seed=3).epoch_order(0)[0])


@pytest.mark.parametrize("mode, per_request", [("in_place", 1), ("recompute", 1), ("in_place", 3), ("recompute", 3)])
@pytest.mark.parametrize("k", [1, 2])
def test_every_trained_token_is_within_the_staleness_bound_and_every_prompt_trained_once(k, mode, per_request):
    fleet = FakeFleet(tokens=lambda prompt, attempt: 3 + 4 * (prompt % 3))
    stream = make_stream(fleet, k, mode=mode, groups_per_request=per_request)
    try:
        stream.start(0, 0)
        taken = run_steps(stream, fleet, 0, 8, train_s=0.04)  # over two epochs; responses <= 22 ms
    finally:
        stream.close()
    for r, (flights, _) in taken.items():
        assert len(flights) == P
        staleness = staleness_metrics([f.samples for f in flights], r)
        assert staleness["async/staleness_max"] <= k
        for f in flights:  # each span's version is what the engine had when it sampled those tokens
            for s in f.samples:
                assert s.response_length == 3 + 4 * (s.prompt_index % 3)
                assert all(r - k <= v <= r for v in s.weight_versions)
    assert_once_each(taken, epochs=2)  # with retry nothing is lost
    if mode == "in_place":
        assert "/pause_generation" in fleet.calls and "/continue_generation" in fleet.calls
    else:
        assert not fleet.calls  # recompute aborts instead of holding


def test_a_request_updated_in_place_records_both_versions():
    fleet = FakeFleet(tokens=lambda prompt, attempt: 40, step_s=0.003)
    stream = make_stream(fleet, 1)
    try:
        stream.start(0, 0)
        taken = run_steps(stream, fleet, 0, 3, train_s=0.03)
    finally:
        stream.close()
    spanned = [s for flights, _ in taken.values() for f in flights for s in f.samples if len(s.weight_versions) > 1]
    assert spanned, "no request ran across a weight update"
    for s in spanned:
        assert s.weight_versions == sorted(s.weight_versions) and sum(s.span_lengths) == 40


def test_recompute_aborts_running_requests_and_continues_them():
    fleet = FakeFleet(tokens=lambda prompt, attempt: 40, step_s=0.003)
    stream = make_stream(fleet, 1, mode="recompute")
    try:
        stream.start(0, 0)
        taken = run_steps(stream, fleet, 0, 3, train_s=0.03)
    finally:
        stream.close()
    assert fleet.abort_count, "the pause aborted nothing"
    samples = [s for flights, _ in taken.values() for f in flights for s in f.samples]
    continued = [s for s in samples if len(s.span_lengths) > 1]
    assert continued and all(s.response_length == 40 for s in samples)
    assert fleet.requests > 2 * P  # continued groups went out again


@pytest.mark.parametrize("stale", ["retry", "drop"])
def test_a_group_too_old_is_retried_or_dropped(stale):
    """The first prompt drawn is 80 tokens long on its first attempt: with trains of ~0.03 s it spans
    more than one push."""
    slow, calls = first_prompt(), Counter()

    def tokens(prompt, attempt):  # slow in epoch 0 only: its two samples' first requests
        calls[prompt, attempt] += 1
        return 80 if prompt == slow and attempt == 0 and calls[prompt, attempt] <= 2 else 2

    fleet = FakeFleet(tokens=tokens, step_s=0.004)
    stream = make_stream(fleet, 1, stale=stale)
    try:
        stream.start(0, 0)
        taken = run_steps(stream, fleet, 0, 5, train_s=0.03)
        dropped = list(stream.dropped)
    finally:
        stream.close()
    stale_counts = sum(m.get("async/groups_stale", 0) for _, m in taken.values())
    assert stale_counts == 1
    if stale == "retry":
        assert_once_each(taken, epochs=1)
        assert sum(m.get("async/groups_retried", 0) for _, m in taken.values()) == 1
    else:
        assert_once_each(taken, epochs=1, missing={slow})
        assert [f.samples[0].prompt_index for f in dropped] == [slow]
        assert taken[4][1]["async/dropped_stale_frac"] == pytest.approx(1 / (1 + 5 * P))


def test_filtered_groups_are_counted_and_more_are_drawn():
    fleet = FakeFleet()
    stream = make_stream(fleet, 2, keep=lambda group: (group[0].reward > 0, "zero_reward"))
    try:
        stream.start(0, 0)
        taken = run_steps(stream, fleet, 0, 1)
    finally:
        stream.close()
    flights, metrics = taken[0]
    assert all(f.samples[0].prompt_index % 2 == 1 for f in flights)
    assert metrics["async/groups_dropped/zero_reward"] >= 1


def test_the_stream_runs_ahead_to_the_staleness_window_only_while_the_trainer_waits():
    """While take(0) waits, rollouts 0..2 may use version-0 groups (k=2): 3 takes' worth start. Once
    the trainer trains, one take's worth is kept outstanding, not the whole window."""
    fleet = FakeFleet(tokens=lambda prompt, attempt: 30, step_s=0.01)
    stream = make_stream(fleet, 2)
    try:
        stream.start(0, 0)
        waiting = threading.Thread(target=stream.take, args=(0,))
        waiting.start()
        time.sleep(0.1)
        assert stream._on_loop(_outstanding, stream) == 3 * P
        waiting.join(timeout=20)
        for r in (1, 2):  # ready at once: the trainer does not wait
            stream.pause()
            fleet.version = r
            stream.resume(r)
            stream.take(r)
        time.sleep(0.6)  # a slow train step: what started has finished, and no more started
        assert stream._on_loop(_outstanding, stream) == P
    finally:
        stream.close()


def test_over_sampled_groups_stand_in_for_the_ones_the_filter_drops():
    """over_sampling_groups = P + 2: two more groups outstanding than a take's worth, while the trainer
    waits (the window) and while it trains; a take still holds P groups, all passing the filter."""
    fleet = FakeFleet(tokens=lambda prompt, attempt: 30, step_s=0.01)
    stream = make_stream(fleet, 2, over_sampling=P + 2, keep=lambda group: (group[0].reward > 0, "zero_reward"))
    try:
        stream.start(0, 0)
        waiting = threading.Thread(target=stream.take, args=(0,))
        waiting.start()
        time.sleep(0.1)
        assert stream._on_loop(_outstanding, stream) == 3 * P + 2
        waiting.join(timeout=20)
        taken = run_steps(stream, fleet, 1, 3)
        time.sleep(0.8)  # a slow train step: what started has finished, and no more started
        assert stream._on_loop(_outstanding, stream) == P + 2
    finally:
        stream.close()
    for flights, _ in taken.values():
        assert len(flights) == P and all(f.samples[0].prompt_index % 2 == 1 for f in flights)


async def _outstanding(stream):
    return len(stream.running) + len(stream.ready)


def test_state_dict_resumes_with_every_prompt_trained_once():
    """Killed after take 1 (its state saved then), resumed in a new stream: the groups in flight at the
    save restart from their prompts, the ready ones are trained, nothing twice, nothing lost."""
    fleet = FakeFleet(tokens=lambda prompt, attempt: 3 + 5 * (prompt % 2))
    first = make_stream(fleet, 2)
    try:
        first.start(0, 0)
        before = run_steps(first, fleet, 0, 1)
        before[1] = first.take(1)
        state = first.state_dict()  # the checkpoint after train(1)
        run_steps(first, fleet, 2, 3)  # work after the checkpoint, lost with the crash
    finally:
        first.close()
    assert state["ready"] or state["pending"]
    fleet2 = FakeFleet(tokens=lambda prompt, attempt: 3 + 5 * (prompt % 2))
    fleet2.version = 2
    second = make_stream(fleet2, 2)
    try:
        second.load_state_dict(state)
        second.start(2, 2)
        after = run_steps(second, fleet2, 2, 8)
    finally:
        second.close()
    assert_once_each({**before, **after}, epochs=2)


def test_take_times_out_naming_what_it_waited_for():
    fleet = FakeFleet(tokens=lambda prompt, attempt: 10_000)
    stream = make_stream(fleet, 1, timeout_s=0.3)
    try:
        stream.start(0, 0)
        with pytest.raises(StreamTimeout, match=r"rollout 0: waited 0s for 4 groups .* 0 ready, 8 generating"):
            stream.take(0)
    finally:
        stream.close()


def test_a_failed_generation_fails_the_take():
    class Broken(FakeFleet):
        async def generate(self, client, samples, params, seeds, rids, what):
            raise RuntimeError(f"{what}: engine answered 500")

    stream = make_stream(Broken(), 1)
    try:
        stream.start(0, 0)
        with pytest.raises(RuntimeError, match=r"rollout stream, group \d+ \(prompt \d+\): engine answered 500"):
            stream.take(0)
    finally:
        stream.close()
