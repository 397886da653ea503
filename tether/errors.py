"""Failures that explain themselves: the CLI prints their message (no traceback) and exits 1.

They live here, below the parts that raise them and without torch or Ray, so that the CLI can
catch them without importing the training stack.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

TIMEOUTS = (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)
"""What a timed-out wait raises: on Python 3.10, asyncio.wait_for and Future.result raise their own
classes, which 3.11 made the builtin TimeoutError. Catch this tuple, not TimeoutError alone."""


class ConfigError(ValueError):
    """A config value is missing, unknown or inconsistent; the message names the field."""


class NonFiniteError(RuntimeError):
    """Training produced NaN/inf: the step was not applied, nothing was saved or pushed."""


class EngineDiedError(RuntimeError):
    """A rollout or eval failed because an engine process died; says which, why, and its log's tail."""


class EngineStartError(RuntimeError):
    """An engine server did not come up: which one, its command and the last lines of its log."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, no permission): which file, and which earlier
    checkpoint is still the latest (the failed one was removed; a resume starts from that one)."""


class EnginesLostInPush(RuntimeError):
    """Engines (by index) died or froze while the trainer pushed weights into them: the loop replaces
    them, the replacements get the current weights, and the push is made again."""

    def __init__(self, indices: list[int], reason: str):
        super().__init__(f"engine(s) {indices} lost during the weight push: {reason}")
        self.indices, self.reason = list(indices), reason

    def __reduce__(self):  # raised in the train actor, caught by the driver: pickled with its fields
        return (EnginesLostInPush, (self.indices, self.reason))


class TrainerDiedError(RuntimeError):
    """A trainer rank's process died: which rank, during which call, and Ray's reason."""


class RemoteTimeout(TimeoutError):
    """A remote call did not finish in time; the message says which call (and which ranks)."""


class SampleFailure(RuntimeError):
    """Raised inside a generate function, tool or environment adapter when one sample cannot go on for
    a reason outside the policy's control. The rollout retries the sample (``rollout.failures``) and
    masks it when it still fails; it is never scored 0. ``kind`` names the failure class in metrics
    and dumps."""

    kind = "generate"


class ToolFailure(SampleFailure):
    """A tool's infrastructure failed (its sandbox did not start, its server is gone). A tool's ordinary
    errors (bad arguments, an exception in the user's program) are its output to the model instead."""

    kind = "tool"


class EnvironmentFailure(SampleFailure):
    """An environment failed (its server did not answer, reset or step raised)."""

    kind = "environment"


class RolloutFailed(RuntimeError):
    """A rollout had more failed samples than ``rollout.failures`` allows, or too few left to train on:
    how many of which kind, the first errors, and the dump that lists them all."""


class RolloutStalled(RuntimeError):
    """A rollout made no progress for ``rollout.failures.stall_timeout_s``: the groups it waited on,
    their engines and their stacks."""
