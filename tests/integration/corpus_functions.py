"""User functions that misbehave, for the bad-input corpus: each raises, hangs, or returns NaN, None,
a string or the wrong length, where a run calls it."""

import math
import time

from tether.algorithms.losses import ppo_clip_loss


# ------------------------------------------------------------ rewards: fn(sample) -> float
def reward_raises(sample):
    return 1 / 0


def reward_nan(sample):
    return math.nan


def reward_none(sample):
    return None


def reward_text(sample):
    return "correct"


def reward_hangs(sample):
    time.sleep(60)
    return 1.0


def reward_dict_without_key(sample):
    return {"accuracy": 1.0}


def group_reward_short(samples):
    return [1.0] * (len(samples) - 1)


def group_reward_raises(samples):
    raise ValueError("judge unavailable")


# ------------------------------------------------------------ dynamic filters: fn(group) -> bool
def filter_raises(samples):
    raise KeyError("score")


def filter_text(samples):
    return "yes"


def filter_none(samples):
    return None


# ------------------------------------------------------------ generate functions: async (ctx, sample, params)
async def generate_none(ctx, sample, sampling_params):
    await ctx.generate_into(sample, sampling_params)


async def generate_raises(ctx, sample, sampling_params):
    raise RuntimeError("tool server refused")


async def generate_text(ctx, sample, sampling_params):
    return sample.prompt + " 42"


async def generate_misaligned(ctx, sample, sampling_params):
    await ctx.generate_into(sample, sampling_params)
    sample.response_logprobs = sample.response_logprobs[:-1]  # one log-prob short
    return sample


async def generate_empty_list(ctx, sample, sampling_params):
    return []


# ------------------------------------------------------------ policy losses: (inp, params) -> (loss, metrics)
def loss_nan(inp, params):
    loss, metrics = ppo_clip_loss(inp, params)
    return loss * math.nan, metrics


def loss_none(inp, params):
    return None


def loss_vector(inp, params):
    loss, metrics = ppo_clip_loss(inp, params)
    return loss.expand(3), metrics
