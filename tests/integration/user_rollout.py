"""Rollout functions loaded by file path in the tests (slime's rollout function shape)."""

import asyncio

from tether.rollout.rollout_fn import RolloutOutput

async def plain(ctx, rollout_id, data_source):
    """What the built-in rollout does without a filter: draw, generate, return (scored by tether)."""
    groups = data_source.get_samples(ctx.cfg.rollout.prompts_per_rollout)
    await asyncio.gather(*(ctx.generate_group(g) for g in groups))
    return groups


async def best_of_two(ctx, rollout_id, data_source, evaluation=False):
    """Draws twice the groups, scores them itself, keeps the higher-reward half and hands the rest back."""
    if evaluation:
        groups = data_source.get_samples()
        await asyncio.gather(*(ctx.generate_group(g) for g in groups))
        return RolloutOutput(groups, {"my_eval_metric": 2.0})
    need = ctx.cfg.rollout.prompts_per_rollout
    groups = data_source.get_samples(2 * need)
    await asyncio.gather(*(ctx.generate_group(g) for g in groups[:need]))
    await asyncio.gather(*(ctx.score_group(g) for g in groups[:need]))
    data_source.add_samples(groups[need:])
    return RolloutOutput(groups[:need], {"rollout/my_metric": 1.5})


def sync_rollout(ctx, rollout_id, data_source):
    """A sync function: runs in a worker thread and waits on ctx's coroutines with ctx.run."""
    groups = data_source.get_samples(ctx.cfg.rollout.prompts_per_rollout)
    for g in groups:
        ctx.run(ctx.generate_group(g))
        for s in g:
            s.reward = float(s.sample_index)
    return groups


async def raises(ctx, rollout_id, data_source):
    data_source.get_samples(1)
    raise KeyError("no such tool")


async def returns_text(ctx, rollout_id, data_source):
    return "groups"


async def too_few(ctx, rollout_id, data_source):
    groups = data_source.get_samples(1)
    await ctx.generate_group(groups[0])
    return groups


async def ungenerated(ctx, rollout_id, data_source):
    return data_source.get_samples(ctx.cfg.rollout.prompts_per_rollout)
