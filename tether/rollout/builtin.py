"""The built-in rollout function: tether's own rollout, written as a rollout function like yours.

Training: groups stream through the driver (tether/rollout/driver.py) from the data source, are
scored as they finish and kept when the dynamic filter passes them, until ``prompts_per_rollout``
are kept; with partial rollout, the groups cut short wait in the buffer for the next rollout.
Evaluation: every group of the eval set, kept as generated.
"""

from __future__ import annotations

import itertools

from tether.rollout.buffer import mask_stale_spans
from tether.rollout.driver import DriverResult, Schedule
from tether.rollout.filters import keep_all
from tether.rollout.rollout_fn import EvalDataSource, RolloutContext, RolloutDataSource, RolloutOutput


class DataExhaustedError(RuntimeError):
    """The epoch's prompts ran out before enough groups passed the dynamic filter."""


async def builtin_rollout(ctx: RolloutContext, rollout_id: int, data_source: RolloutDataSource | EvalDataSource,
                          evaluation: bool = False) -> RolloutOutput:
    # An eval set's source comes with evaluation=True, the training prompts' without (the manager's calls).
    if evaluation:
        assert isinstance(data_source, EvalDataSource)
        return await _eval(ctx, data_source)
    assert isinstance(data_source, RolloutDataSource)
    r = ctx.cfg.rollout
    data, buffer = data_source.data, data_source.buffer
    carried = buffer.take()  # partial rollout: last rollout's unfinished groups go first
    groups = _tagged(itertools.chain(carried, data.peek_groups()), rollout_id)
    result = await ctx.driver.arun(groups, ctx.schedule, ctx.params, ctx.seed, ctx.score_group, ctx.keep, ctx.what)
    continued = min(len(carried), result.started)
    if r.partial_rollout:  # every fresh group started is used up: kept, dropped, or carried on
        data.advance(result.started - continued)
        # Oldest first, so no group waits behind newer ones: carried groups (those started again,
        # then those not reached), then this rollout's fresh ones.
        for group in result.leftover:  # scored again when kept (with the reward of that rollout)
            for s in group:
                s.reward = s.reward_info = None
                if s.failure is not None and s.failure["kind"] in ("reward", "unscored"):  # its response is fine
                    s.failure, s.remove = None, False
        was_carried = {id(g) for g in carried}
        buffer.put([g for g in result.leftover if id(g) in was_carried] + carried[continued:]
                   + [g for g in result.leftover if id(g) not in was_carried])
    else:
        data.advance(result.consumed)
    warnings = _check_exhausted(ctx, result, rollout_id)
    groups = [_renumbered(group, k) for k, group in enumerate(result.kept)]
    if r.partial_rollout:
        samples = [s for g in groups for s in g]
        result.metrics.update({"rollout/groups_continued": float(continued),
                               "rollout/buffer_groups": float(len(buffer)),
                               "rollout/multi_version_samples": float(sum(len(set(s.weight_versions)) > 1
                                                                          for s in samples))})
        if r.mask_offpolicy_partial:
            result.metrics["rollout/offpolicy_tokens_masked"] = float(sum(mask_stale_spans(s) for s in samples))
    return RolloutOutput(groups, result.metrics, warnings)


async def _eval(ctx: RolloutContext, data_source: EvalDataSource) -> RolloutOutput:
    groups = data_source.get_samples()
    schedule = Schedule(need=len(groups), over_sampling_groups=len(groups),
                        max_concurrent_groups=ctx.cfg.rollout.max_concurrent_groups, waves=ctx.cfg.deterministic,
                        groups_per_request=ctx.cfg.rollout.groups_per_request)
    result = await ctx.driver.arun(iter(groups), schedule, ctx.params, ctx.seed, ctx.score_group, keep_all, ctx.what,
                                   evaluation=True)
    return RolloutOutput(result.kept, {})


def _tagged(groups, rollout_id: int):
    for group in groups:
        for s in group:
            s.rollout_id = rollout_id
        yield group


def _renumbered(group, k: int):
    # A kept group's index is its place in the trained batch (the driver numbered it by start order).
    for s in group:
        s.group_index = k
    return group


def _check_exhausted(ctx: RolloutContext, result: DriverResult, rollout_id: int) -> list[str]:
    r = ctx.cfg.rollout
    if not result.exhausted:
        return []
    text = (f"rollout {rollout_id}: the epoch's prompts ran out with {len(result.kept)} of "
            f"rollout.prompts_per_rollout={r.prompts_per_rollout} groups passing rollout.dynamic_filter "
            f"'{r.dynamic_filter}' ({int(result.metrics['rollout/groups_started'])} started)")
    if not result.kept or r.on_data_exhausted == "fail":
        raise DataExhaustedError(text + ("; nothing to train on" if not result.kept else
                                         "; rollout.on_data_exhausted is 'fail'"))
    return [text + "; training on those (rollout.on_data_exhausted: train_on_passed)"]
