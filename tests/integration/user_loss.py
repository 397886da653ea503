"""A user's policy loss that turns NaN after the first rollout (4 loss calls per rollout in the test)."""

from tether.algorithms.losses import ppo_clip_loss

CALLS = [0]


def nan_after_first_rollout(inp, params):
    CALLS[0] += 1
    loss, metrics = ppo_clip_loss(inp, params)
    if CALLS[0] > 4:
        loss = loss * float("nan")
        metrics["pg_loss"] = float("nan")
    return loss, metrics
