"""Custom generate functions through the driver, against a real engine server over HTTP (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tether.engine.sampling import SamplingParams
from tether.rollout.driver import GroupDriver, Schedule
from tether.rollout.filters import keep_all
from tether.rollout.fleet import EngineFleet
from tether.errors import RolloutFailed
from tether.rollout.generate_fn import CustomGenerate, GenerateLoadError
from tether.sample import Sample
from tether.models.hf import load_tokenizer

pytestmark = pytest.mark.integration
N = 3
USER = Path(__file__).parent / "user_generate.py"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def groups(count: int, metadata: dict | None = None):
    return [[Sample(prompt_index=k, sample_index=j, prompt=f"{k}+1=", label=None, metadata=dict(metadata or {}),
                    prompt_ids=[5 + k, 6, 7], rollout_id=2) for j in range(N)] for k in range(count)]


async def score(samples):
    for s in samples:
        s.reward = float(s.response_length) if s.reward is None else s.reward


def run(engine, custom, source, need=None, evaluation=False, keep=keep_all, over=None, max_new_tokens=10):
    driver = GroupDriver(EngineFleet([engine.url], timeout_s=60), timeout_s=60, custom=custom)
    need = need or len(source)
    schedule = Schedule(need=need, over_sampling_groups=over or need, max_concurrent_groups=None, waves=False)
    return driver.run(iter(source), schedule, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens), 7,
                      score, keep, "test rollout", evaluation=evaluation)


def custom(name: str, tokenizer) -> CustomGenerate:
    return CustomGenerate(f"{USER}:{name}", tokenizer=tokenizer)


def test_a_single_turn_function_samples_what_the_built_in_path_does(engine, tokenizer):
    built_in = run(engine, None, groups(3))
    mine = run(engine, custom("single_turn", tokenizer), groups(3))
    assert [[s.response_ids for s in g] for g in mine.kept] == [[s.response_ids for s in g] for g in built_in.kept]
    for g in mine.kept:
        for s in g:
            assert s.status in ("completed", "truncated") and s.loss_mask is None and s.weight_versions == [0]
            assert len(s.response_logprobs) == s.response_length


def test_two_turns_with_inserted_tokens(engine, tokenizer):
    from tests.integration import user_generate

    user_generate.CALLS["evaluation"].clear()
    fn = custom("two_turns", tokenizer)
    module_calls = fn.fns[fn.default].__globals__["CALLS"]["evaluation"]
    result = run(engine, fn, groups(2), max_new_tokens=12)
    tool = tokenizer.encode("<7>", add_special_tokens=False)
    for g in result.kept:
        for s in g:
            first = s.span_lengths[0]
            assert first <= 3 and s.span_lengths[1] == len(tool) and sum(s.span_lengths) == s.response_length
            assert s.response_ids[first:first + len(tool)] == tool
            assert s.loss_mask == [1] * first + [0] * len(tool) + [1] * (s.response_length - first - len(tool))
            assert s.response_logprobs[first:first + len(tool)] == [0.0] * len(tool)
            assert s.response_length <= 12  # max_new_tokens bounds the whole response, tool tokens included
            assert "<7>" in s.response_text and s.weight_versions == [0, 0, 0]
    assert module_calls == [False] * 6
    run(engine, fn, groups(1), evaluation=True)
    assert module_calls[-N:] == [True] * N  # passed because the function takes it


def test_every_turn_conditions_on_the_exact_tokens_the_trainer_sees(engine, tokenizer, tiny_model_dir):
    """Turn 2's prompt is prompt + every response token so far (ids, never re-tokenized text), so the
    trainer's log-probs of the whole sequence equal the engine's on every policy token."""
    from tether.models.hf import load_model

    result = run(engine, custom("two_turns", tokenizer), groups(2), max_new_tokens=12)
    model = load_model(str(tiny_model_dir), "float32")
    for s in (s for g in result.kept for s in g):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        targets = ids[0, 1:]
        trainer = logp.gather(1, targets[:, None])[:, 0][len(s.prompt_ids) - 1:]
        policy = torch.tensor(s.loss_mask, dtype=torch.bool)
        diff = (trainer[policy] - torch.tensor(s.response_logprobs)[policy]).abs().max()
        assert float(diff) < 1e-4, (s.describe(), float(diff))


def test_rewards_set_by_the_function_are_kept(engine, tokenizer):
    result = run(engine, custom("self_scored", tokenizer), groups(2))
    assert [s.reward for s in result.kept[0]] == [{"score": 0.0, "turns": 1.0}, {"score": 1.0, "turns": 1.0},
                                                  {"score": 2.0, "turns": 1.0}]  # the driver's score left them


def test_a_function_may_return_several_samples(engine, tokenizer):
    result = run(engine, custom("two_per_sample", tokenizer), groups(2))
    for g in result.kept:
        assert len(g) == 2 * N and sorted(s.sample_index for s in g) == [0, 1, 2, 100, 101, 102]
        twins = {s.sample_index: s for s in g}
        assert any(twins[j].response_ids != twins[j + 100].response_ids for j in range(N))


def test_sync_functions_and_row_overrides(engine, tokenizer):
    fn = CustomGenerate(None, [(f"{USER}:sync_single_turn", "rows.jsonl:3")], tokenizer=tokenizer)
    source = groups(1, {"generate_fn": f"{USER}:sync_single_turn"}) + groups(1)
    result = run(engine, fn, source)
    assert [s.response_ids for s in result.kept[0]] == [[5, 6]] * N  # the row's function
    assert all(s.response_ids != [5, 6] and s.weight_versions == [0] for s in result.kept[1])  # the built-in path


@pytest.mark.parametrize("name, match", [
    ("raises", r"rollout.custom_generate_fn '.*user_generate.py:raises' raised KeyError: .* at user_generate.py:\d+ "
               r"\(rollout 2, prompt_index=0, sample_index=\d\)"),
    ("misaligned", r"returned a sample that cannot be trained on: rollout 2, prompt_index=0, sample_index=\d: "
                   r"\d+ response tokens but \d+ log-probs"),
    ("wrong_type", r"returned 'text' for rollout 2, prompt_index=0, sample_index=\d; expected a Sample"),
])
def test_a_failing_function_names_itself_and_the_sample(engine, tokenizer, name, match):
    # Every sample fails (kind generate): over the failure budget, the rollout stops quoting the errors.
    with pytest.raises(RolloutFailed, match=match):
        run(engine, custom(name, tokenizer), groups(1))


def test_bad_specs_name_the_field_or_the_row(tokenizer):
    with pytest.raises(GenerateLoadError, match=r"rollout.custom_generate_fn: generate function spec .*missing"):
        CustomGenerate(f"{USER}:missing")
    with pytest.raises(GenerateLoadError, match=r"rows.jsonl:4: metadata.generate_fn: .*not found"):
        CustomGenerate(None, [("nowhere.py:fn", "rows.jsonl:4")])


def test_an_abort_reaches_a_multi_turn_function(engine, tokenizer):
    """1 group of 4 is needed: group 0 (a function that answers at once) is kept the moment it is
    judged, while the others are in their first turn. They are cut short: the abort reaches the
    request in flight, or the next turn answers "abort" at once."""
    instant = f"{USER}:sync_single_turn"
    fn = CustomGenerate(f"{USER}:two_turns", [(instant, "rows.jsonl:1")], tokenizer=tokenizer)
    source = groups(1, {"generate_fn": instant}) + groups(3)
    result = run(engine, fn, source, need=1, over=4, max_new_tokens=50)
    assert [g[0].prompt_index for g in result.kept] == [0]
    assert len(result.unfinished) == 3 and result.metrics["rollout/groups_aborted"] == 3
    for s in (s for g in result.unfinished for s in g):
        assert s.status == "aborted" and s.response_length < 50 and s.check_aligned() is None


def test_a_second_turn_reuses_the_first_through_the_prefix_cache(tiny_model_dir, tokenizer):
    from tether.engine.core import EngineCore
    from tether.engine.embedded import EmbeddedEngine
    from tether.engine.server import EngineServer
    from tether.rollout.fleet import prefix_cache_metrics

    core = EngineCore(EmbeddedEngine(str(tiny_model_dir)), tokenizer, prefix_cache_tokens=4096)
    server = EngineServer(core).start()
    try:
        fleet = EngineFleet([server.url], timeout_s=60)
        before = fleet.prefill_counters()
        result = run(server, custom("long_two_turns", tokenizer), groups(2), max_new_tokens=30)
        metrics = prefix_cache_metrics(before, fleet.prefill_counters(), "rollout")
    finally:
        server.stop()
    assert all(s.span_lengths[:2] == [20, 3] for g in result.kept for s in g)
    # Each sample's second prompt (3 + 20 + 3 tokens) finds its first 16 in the cache: 6 x 16 of the
    # 2 x 3 (shared within each group's batch) + 6 x 26 prompt tokens prefilled.
    assert metrics["rollout/prefix_cache_hit_rate"] == pytest.approx(6 * 16 / (6 * 3 + 6 * 26))
