"""Samples that fail: what kind of failure, whether it is tried again, and how many a rollout may have.

A failed sample is not a zero. Scoring it 0 would teach the policy that whatever it wrote caused a
sandbox to crash; so a sample whose generation, tool, environment or reward fails is tried again
when its kind is retried (``rollout.failures.retry``, ``max_attempts`` in all), and one that still
fails is marked (``Sample.fail``): removed from its group's statistics and the loss, left out of the
reward metrics, counted per kind and dumped with its error. A group with no sample left is replaced
by the next prompt (or kept, trained on nothing: ``failed_groups: shrink``).

Kinds:
- engine: the engine timed out or answered with an error (a lost engine's group moves to another
  engine instead, within cluster.max_engine_restarts);
- tool / environment: ToolFailure / EnvironmentFailure raised by a tool, an environment adapter or
  the user's own code (tether/errors.py);
- reward: the reward function raised, timed out or returned something that is not a reward;
- generate: any other exception in a generate function;
- stall: the group was waiting when the stall watchdog dropped it (tether/rollout/watchdog.py);
- unscored: the reward function returned None ("not scored", as TRL's reward functions may). Not a
  failure in the budget; such a sample is not trained on either.

Budgets, per rollout: ``max_failed_frac`` of the samples it trains on may fail (counted as they fail,
so a storm of failures stops the rollout early instead of replacing prompts until the data runs out),
and at least ``min_trained_frac`` of its batch must be trained on.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import httpx

from tether.errors import RolloutFailed, SampleFailure
from tether.sample import RETRIES, UNSCORED, Sample

EXAMPLES = 5
"""Failures quoted in full when a budget stops a run."""


def classify(err: BaseException) -> str:
    """The failure kind of an exception raised while generating a sample (its causes looked through: a
    generate function's error wraps what it raised)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, SampleFailure):
            return seen.kind
        if isinstance(seen, (httpx.TimeoutException, EngineReplyError)):
            return "engine"
        seen = seen.__cause__
    return "generate"


class EngineReplyError(RuntimeError):
    """An engine answered a generate function's request with an error status."""


@dataclass(frozen=True)
class FailurePolicy:
    max_attempts: int = 3
    retry: frozenset[str] = frozenset({"tool", "environment", "reward"})
    max_failed_frac: float = 0.1
    min_trained_frac: float = 0.5
    replace_groups: bool = True
    stall_timeout_s: float | None = 900.0
    drop_on_stall: bool = False

    @classmethod
    def from_config(cls, f) -> FailurePolicy:
        """From ``rollout.failures`` (tether/rollout/config.py FailuresConfig)."""
        return cls(max_attempts=f.max_attempts, retry=frozenset(f.retry), max_failed_frac=f.max_failed_frac,
                   min_trained_frac=f.min_trained_frac, replace_groups=f.failed_groups == "replace",
                   stall_timeout_s=f.stall_timeout_s, drop_on_stall=f.on_stall == "drop")

    def attempts(self, kind: str) -> int:
        """Attempts a sample gets at a failure of this kind."""
        return self.max_attempts if kind in self.retry else 1

    def allowed(self, batch_samples: int) -> int:
        """Failed samples a rollout training on ``batch_samples`` samples may have."""
        return math.floor(self.max_failed_frac * batch_samples + 1e-9)


@dataclass
class FailureLog:
    """The failures and retries of the groups judged in one rollout (or one take of the stream)."""

    failed: Counter = field(default_factory=Counter)
    retried: Counter = field(default_factory=Counter)
    unscored: int = 0
    judged: int = 0
    """Samples of the groups judged."""
    examples: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    """Every failed sample as dumped (Sample.to_dict), kept groups' and dropped ones'."""

    def add_group(self, samples: list[Sample]) -> None:
        self.judged += len(samples)
        for s in samples:
            for key, n in s.metrics.items():
                if key.startswith(RETRIES):
                    self.retried[key[len(RETRIES):]] += int(n)
            if s.failure is None:
                continue
            self.rows.append(s.to_dict())
            if s.failure["kind"] == UNSCORED:
                self.unscored += 1
                continue
            self.failed[s.failure["kind"]] += 1
            if len(self.examples) < EXAMPLES:
                self.examples.append(f"{s.describe()}: {s.failure['kind']} after {s.failure['attempts']} "
                                     f"attempt(s): {s.failure['error'][:400]}")

    def merge(self, other: FailureLog) -> None:
        self.failed.update(other.failed)
        self.retried.update(other.retried)
        self.unscored += other.unscored
        self.judged += other.judged
        self.examples = (self.examples + other.examples)[:EXAMPLES]
        self.rows += other.rows

    @property
    def total(self) -> int:
        return sum(self.failed.values())

    def metrics(self) -> dict[str, float]:
        out = {"failures/samples": float(self.total), "failures/unscored": float(self.unscored)}
        out.update({f"failures/{k}": float(n) for k, n in self.failed.items()})
        out.update({f"failures/retried/{k}": float(n) for k, n in self.retried.items()})
        return out

    def check(self, policy: FailurePolicy, batch_samples: int, what: str) -> None:
        """RolloutFailed once more samples failed than the policy allows."""
        allowed = policy.allowed(batch_samples)
        if self.total > allowed:
            kinds = ", ".join(f"{k} {n}" for k, n in self.failed.most_common())
            raise RolloutFailed(
                f"{what}: {self.total} samples failed ({kinds}); rollout.failures.max_failed_frac="
                f"{policy.max_failed_frac:g} allows {allowed} of the {batch_samples} samples a rollout trains on. "
                "First failures:\n  " + "\n  ".join(self.examples))


def check_trained(samples: list[Sample], policy: FailurePolicy, what: str) -> float:
    """The share of a batch not failed (nor unscored); RolloutFailed below ``min_trained_frac``. (Samples a
    filter removed on purpose do not count against it.)"""
    trained = sum(not s.failed for s in samples) / max(1, len(samples))
    if trained < policy.min_trained_frac:
        reasons = Counter(s.failure["kind"] for s in samples if s.failure)
        example = next(s.failure for s in samples if s.failure and s.failure["kind"] == reasons.most_common(1)[0][0])
        raise RolloutFailed(
            f"{what}: only {trained:.0%} of its {len(samples)} samples can be trained on "
            f"(rollout.failures.min_trained_frac={policy.min_trained_frac:g}); left out: "
            + ", ".join(f"{k} {n}" for k, n in reasons.most_common())
            + ("; a reward function returning None marks a sample unscored" if UNSCORED in reasons else "")
            + f". E.g. {example['kind']}: {example['error'][:400]}")
    return trained
