"""Generate functions in the fully asynchronous stream, against a real engine server over HTTP (no Ray):
the same group runner as the synchronous driver, so a multi-turn function with inserted tool tokens
streams across takes and weight-update pauses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.engine.sampling import SamplingParams
from tether.models.hf import load_tokenizer
from tether.rollout.data_source import DataSource, PromptRow
from tether.rollout.fleet import EngineFleet
from tether.rollout.generate_fn import CustomGenerate
from tether.rollout.stream import RolloutStream, StreamSettings

pytestmark = pytest.mark.integration
USER = Path(__file__).parent / "user_generate.py"
ROWS, NEED, N = 6, 2, 2


async def score(group):
    for s in group:
        s.reward = float(s.response_length % 2)


def rows(metadata: dict) -> list[PromptRow]:
    return [PromptRow(index=i, line=i + 1, prompt=f"{i}+1=", label=None, metadata=dict(metadata),
                      prompt_ids=[5 + i, 6, 7]) for i in range(ROWS)]


@pytest.mark.parametrize("mode", ["in_place", "recompute"])
@pytest.mark.parametrize("where", ["config", "row"])
def test_a_multi_turn_function_streams_across_takes_and_pauses(engine, tiny_model_dir, mode, where):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    spec = f"{USER}:two_turns"
    # The run's function (rollout.custom_generate_fn) or one a data row names (metadata.generate_fn).
    custom = CustomGenerate(spec, tokenizer=tokenizer) if where == "config" else \
        CustomGenerate(None, [(spec, "rows.jsonl:1")], tokenizer=tokenizer)
    data = DataSource(rows({} if where == "config" else {"generate_fn": spec}), prompts_per_rollout=NEED,
                      n_samples_per_prompt=N, shuffle=True, seed=0)
    settings = StreamSettings(need=NEED, max_staleness=4, start_per_take=NEED, max_in_flight=None,
                              stale_groups="retry", groups_per_request=1, pause_mode=mode, seed=0, timeout_s=60)
    stream = RolloutStream(EngineFleet([engine.url], timeout_s=60), data,
                           SamplingParams(temperature=1.0, max_new_tokens=12), settings, score,
                           lambda group: (True, ""), custom)
    tool = tokenizer.encode("<7>", add_special_tokens=False)
    taken = []
    try:
        stream.start(0, 0)
        for r in range(3):
            flights, metrics = stream.take(r)
            taken += flights
            stream.pause()  # no push: the engine keeps version 0, the stream counts on
            stream.resume(r + 1)
    finally:
        stream.close()
    # The first groups to finish are taken, and while the trainer waits the stream starts more (the next
    # epoch's too), so which prompts come is a race; each is drawn at most once an epoch.
    drawn = [(f.epoch, f.samples[0].prompt_index) for f in taken]
    assert len(taken) == 3 * NEED and len(set(drawn)) == len(drawn), drawn
    for flight in taken:
        assert len(flight.samples) == N
        for s in flight.samples:
            first = s.span_lengths[0]
            assert s.response_ids[first:first + len(tool)] == tool  # the function's inserted tool tokens
            assert s.loss_mask[first:first + len(tool)] == [0] * len(tool)
            assert s.status in ("completed", "truncated") and set(s.weight_versions) == {0}
            assert s.reward == float(s.response_length % 2)


@pytest.mark.parametrize("budget", [1.0, 0.0])
def test_failed_samples_stream_masked_and_a_storm_stops_the_take(engine, tiny_model_dir, budget):
    """The stream's groups go through the same failure handling: a sample that fails is masked (its
    group still trains); over the budget, the next take stops naming the failures."""
    from tether.errors import RolloutFailed
    from tether.rollout.failures import FailurePolicy

    policy = FailurePolicy(max_failed_frac=budget, min_trained_frac=0.0)
    custom = CustomGenerate(f"{USER}:fails_sample_1", tokenizer=load_tokenizer(str(tiny_model_dir)), policy=policy)
    data = DataSource(rows({}), prompts_per_rollout=NEED, n_samples_per_prompt=N, shuffle=True, seed=0)
    settings = StreamSettings(need=NEED, max_staleness=4, start_per_take=NEED, max_in_flight=None,
                              stale_groups="retry", groups_per_request=1, pause_mode="in_place", seed=0, timeout_s=60,
                              policy=policy)

    async def keep_rewards(group):
        for s in group:
            if not s.failed:
                s.reward = 1.0

    stream = RolloutStream(EngineFleet([engine.url], timeout_s=60), data,
                           SamplingParams(temperature=1.0, max_new_tokens=6), settings, keep_rewards,
                           lambda group: (True, ""), custom)
    try:
        stream.start(0, 0)
        if budget == 0.0:
            with pytest.raises(RolloutFailed, match=r"rollout stream, before take 0: \d+ samples failed \(generate"):
                stream.take(0)
            return
        flights, metrics = stream.take(0)
    finally:
        stream.close()
    assert metrics["failures/generate"] >= NEED and len(stream.taken_failures.rows) == metrics["failures/samples"]
    for flight in flights:
        good, bad = flight.samples
        assert not good.failed and good.reward == 1.0 and bad.failed and bad.failure["kind"] == "generate"
