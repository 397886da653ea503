"""Generate functions loaded by file path in the tests (slime's custom generate function shape)."""

from tether.sample import Sample

CALLS = {"evaluation": []}


async def single_turn(ctx, sample, sampling_params):
    """What the built-in path does, written as a generate function."""
    await ctx.generate_into(sample, sampling_params)
    return sample


async def two_turns(ctx, sample, sampling_params, evaluation=False):
    """Up to 3 policy tokens, then a tool's answer is inserted, then the policy goes on."""
    CALLS["evaluation"].append(evaluation)
    first = await ctx.generate_into(sample, {**sampling_params, "max_new_tokens": 3 + sample.response_length})
    if first.aborted:
        return sample
    ctx.insert(sample, "<7>")
    await ctx.generate_into(sample, sampling_params)
    return sample


async def self_scored(ctx, sample, sampling_params):
    await ctx.generate_into(sample, sampling_params)
    sample.reward = {"score": float(sample.sample_index), "turns": 1.0}
    return sample


async def two_per_sample(ctx, sample, sampling_params):
    """Each sample becomes two (say, two agents answering the same prompt)."""
    twin = Sample(sample.prompt_index, sample.sample_index + 100, sample.prompt, sample.label, dict(sample.metadata),
                  list(sample.prompt_ids), rollout_id=sample.rollout_id)
    await ctx.generate_into(sample, sampling_params)
    await ctx.generate_into(twin, sampling_params)
    return [sample, twin]


async def raises(ctx, sample, sampling_params):
    await ctx.generate_into(sample, sampling_params)
    return {"not": "a sample"}[sample.response_text]


async def misaligned(ctx, sample, sampling_params):
    await ctx.generate_into(sample, sampling_params)
    sample.response_ids = sample.response_ids + [5]  # appended without its log-prob
    return sample


async def wrong_type(ctx, sample, sampling_params):
    return "text"


def sync_single_turn(ctx, sample, sampling_params):
    """A sync function is called as it is (no awaiting)."""
    sample.add_generated([5, 6], [-1.0, -1.0], "ab", 0)
    sample.finish_reason = "stop"
    return sample


async def long_two_turns(ctx, sample, sampling_params):
    """20 policy tokens, an inserted answer, then more: the second turn's prompt holds a whole KV block."""
    await ctx.generate_into(sample, {**sampling_params, "max_new_tokens": 20, "ignore_eos": True})
    ctx.insert(sample, "<7>")
    await ctx.generate_into(sample, sampling_params)
    return sample


async def calculator_turns(ctx, sample, sampling_params):
    """Up to 3 policy tokens, then the calculator's value of the prompt ("3+4=" -> "<7>"), then the rest."""
    from tether.tools import Calculator

    first = await ctx.generate_into(sample, {**sampling_params, "max_new_tokens": 3 + sample.response_length})
    if first.aborted:
        return sample
    result = await Calculator()(sample.prompt.rstrip("="))
    ctx.insert(sample, f"<{result.output}>")
    sample.metrics["tool_calls"] = 1.0
    await ctx.generate_into(sample, sampling_params)
    return sample


# ---------------------------------------------------------------- failures (tests/integration/test_sample_failures.py)
async def flaky_tool(ctx, sample, sampling_params):
    """A tool whose sandbox fails at sample 0's first attempt: the sample is tried again from its prompt."""
    from tether.errors import ToolFailure
    from tether.run.faults import CURRENT_SAMPLE

    await ctx.generate_into(sample, {**sampling_params, "max_new_tokens": 3})
    if sample.sample_index == 0 and CURRENT_SAMPLE.get().attempt == 1:
        raise ToolFailure("sandbox did not start")
    ctx.insert(sample, "<7>")
    await ctx.generate_into(sample, sampling_params)
    return sample


async def fails_sample_1(ctx, sample, sampling_params):
    """A bug that hits sample 1 of every group (not retried: kind generate)."""
    await ctx.generate_into(sample, sampling_params)
    if sample.sample_index == 1:
        raise ValueError("cannot parse the tool call")
    return sample


async def env_down_for_prompt_0(ctx, sample, sampling_params):
    """Prompt 0's environment never answers (kind environment, retried, then failed)."""
    from tether.errors import EnvironmentFailure

    if sample.prompt_index == 0:
        raise EnvironmentFailure("environment server at http://env:8000 refused the connection")
    await ctx.generate_into(sample, sampling_params)
    return sample


async def hangs_on_sample_0(ctx, sample, sampling_params):
    """Prompt 0's sample 0 waits on a tool that never answers."""
    import asyncio

    await ctx.generate_into(sample, sampling_params)
    if sample.sample_index == 0 and sample.prompt_index == 0:
        await asyncio.Event().wait()
    return sample


async def calls_a_tool(ctx, sample, sampling_params):
    """One turn, a calculator call whose answer is inserted, another turn (the fault-injection run)."""
    from tether.tools import Calculator

    await ctx.generate_into(sample, {**sampling_params, "max_new_tokens": 2})
    result = await Calculator()("6*7")
    ctx.insert(sample, result.output[:1])
    await ctx.generate_into(sample, sampling_params)
    return sample


async def with_sub_agent(ctx, sample, sampling_params):
    """Even samples hand part of the work to a sub-agent: a second segment of the same trajectory (its
    own prompt and response, the same sample_index), returned after the main one."""
    await ctx.generate_into(sample, sampling_params)
    if sample.sample_index % 2:
        return sample
    sub = Sample(sample.prompt_index, sample.sample_index, sample.prompt, sample.label, dict(sample.metadata),
                 list(sample.prompt_ids) + [7], rollout_id=sample.rollout_id)
    await ctx.generate_into(sub, sampling_params)
    return [sample, sub]
