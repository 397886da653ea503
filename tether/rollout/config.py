"""The rollout: section of a recipe (how many rollouts, how big, how responses are sampled, scored and
scheduled), beside the rollout code it configures (tether/config/tree.py assembles the tree). Imports no torch."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from tether.config.base import Section
from tether.envs.config import Environment


class SyncSchedule(Section):
    """Generate a rollout, then train on it (tether/loop.py): every trained token comes from the
    weights being updated."""

    mode: Literal["sync"] = "sync"
    """The synchronous loop."""

    @property
    def max_staleness(self) -> int:
        return 0


class OneStepOffSchedule(Section):
    """slime's train_async: the next rollout generates, under the weights of one step before, while the
    trainer trains; the weights are pushed once both are done. The pipeline drains before a checkpoint
    or an eval, so a resumed run is identical to an uninterrupted one (tether/loop_async.py). Needs
    cluster.colocate: false."""

    mode: Literal["one_step_off"] = "one_step_off"
    """Generation one weight version behind training."""

    @property
    def max_staleness(self) -> int:
        return 1


class FullyAsyncSchedule(Section):
    """Groups stream through the engines across train steps; each train step takes the next
    prompts_per_rollout finished groups at most max_staleness versions old (tether/rollout/stream.py).
    Needs cluster.colocate: false."""

    mode: Literal["fully_async"] = "fully_async"
    """Streaming groups across train steps."""
    max_staleness: int = Field(1, ge=1)
    """Weight versions a trained token may lag the policy being updated."""
    stale_groups: Literal["retry", "drop"] = "retry"
    """A finished group older than max_staleness allows is generated again from its prompt (retry) or
    left untrained (drop; rollouts/rollout_<id>_dropped_stale.jsonl lists them)."""
    pause_mode: Literal["in_place", "recompute"] = "in_place"
    """What running requests do during a weight update. in_place: they hold and continue under the new
    weights with their KV cache (each token's weight version is recorded). recompute: they are aborted
    and continued after the update, their prompt and partial response prefilled again under the new
    weights."""


class FailuresConfig(Section):
    """What a rollout does with samples that fail (tether/rollout/failures.py, docs/failures.md). A
    failed sample is never scored 0: it is retried when its failure's kind is retried, and one that
    still fails is kept out of its group's statistics and the loss (masked), counted and dumped with
    its reason."""

    max_attempts: int = Field(3, ge=1)
    """Attempts per sample for a failure of a retried kind (the first one included): a generate
    function starts the sample again from its prompt; a reward function is called again."""
    retry: list[Literal["tool", "environment", "reward", "generate", "engine"]] = ["tool", "environment", "reward"]
    """The failure kinds retried. tool / environment: a tool or environment raised ToolFailure /
    EnvironmentFailure (infrastructure: a sandbox that did not start, a server gone); reward: the reward
    function raised, timed out or returned something invalid; generate: any other exception of a
    generate function (a bug, usually: not retried by default); engine: an engine timed out on, or
    answered with an error to, a generate function's request. A lost engine is always handled by
    moving the group to another engine (cluster.max_engine_restarts)."""
    max_failed_frac: float = Field(0.1, ge=0, le=1)
    """Failed samples a rollout may have, as a share of the samples it trains on (prompts_per_rollout x
    n_samples_per_prompt); one more stops the run, naming the failures (0: any failure stops it)."""
    min_trained_frac: float = Field(0.5, ge=0, le=1)
    """The share of a rollout's samples that must be trained on (not failed, not unscored); fewer
    stops the run."""
    failed_groups: Literal["replace", "shrink"] = "replace"
    """A group whose every sample failed: dropped and replaced by the next prompt (replace), or kept
    with nothing of it trained on, the batch shrinking by its samples (shrink)."""
    stall_timeout_s: float | None = Field(900.0, gt=0)
    """A rollout in which no request, turn or score completes for this long has stalled: it says which
    groups it waited on, on which engines, with their stacks. None: never checked."""
    on_stall: Literal["fail", "drop"] = "fail"
    """What a stall does: stop the run (fail), or fail the waiting groups' samples (kind "stall") and
    go on without them (drop)."""


Schedule = Annotated[Union[SyncSchedule, OneStepOffSchedule, FullyAsyncSchedule], Field(discriminator="mode")]

MOVED_TO_SCHEDULE = ("max_staleness", "async_mode", "stale_groups", "pause_mode")
MOVED_TO_ENGINE = {"engine": "backend", "external_engines": "urls", "engine_host": "host",
                   "max_generate_batch": "max_generate_batch", "max_batch_tokens": "max_batch_tokens",
                   "prefix_cache_tokens": "prefix_cache_tokens", "onednn_linear": "onednn_linear"}


def _moved_fields(raw: dict[str, Any]) -> str | None:
    """What an older recipe's rollout fields are called now, written out with the recipe's own values."""
    lines = []
    old = {k: raw[k] for k in MOVED_TO_SCHEDULE if k in raw}
    if old:
        staleness = old.get("max_staleness", 0)
        mode = old.get("async_mode", "one_step_off") if staleness else "sync"
        new: dict[str, Any] = {"mode": mode}
        if mode == "fully_async":
            new.update({k: v for k, v in old.items() if k != "async_mode"})
        lines.append(f"rollout.{', rollout.'.join(old)} moved into rollout.schedule, keyed on its mode: write "
                     f"rollout: {{schedule: {_flow(new)}}}")
    engine = {new: raw[old] for old, new in MOVED_TO_ENGINE.items() if old in raw}
    if engine:
        if "urls" in engine:
            engine["backend"] = "external"
        lines.append(f"rollout.{', rollout.'.join(k for k in MOVED_TO_ENGINE if k in raw)} moved to the engine "
                     f"section, keyed on its backend: write engine: {_flow(engine)}")
    return "; ".join(lines) or None


def _flow(values: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in values.items()) + "}"


class RolloutConfig(Section):
    num_rollout: int | None = Field(None, ge=1)
    """Number of rollouts (train iterations). None: num_epoch passes over the data."""
    num_epoch: int = Field(1, ge=1)
    """Passes over the prompt data when num_rollout is not set."""
    prompts_per_rollout: int = Field(32, ge=1)
    """Prompts drawn per rollout (the rollout batch size)."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Responses sampled per prompt: one group for group-relative advantages."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer divides logits by the same value when recomputing log-probs."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: int = Field(-1, ge=-1)
    """Keep the k most likely tokens (-1: all)."""
    max_response_len: int = Field(64, ge=1)
    """Maximum new tokens per response."""
    stop_token_ids: list[int] = []
    """Extra token ids that end a response (the tokenizer's eos always does)."""
    reward: str = "math"
    """Reward function: a built-in name (math, exact_match, f1, reasoning_gym,
    reasoning_gym_format; tether/rewards/builtin.py), module:function, path/file.py:function
    (sync or async, of one sample), or the URL of a reward server (http://host:port/path, one POST per group)."""
    group_reward: str | None = None
    """A function of a whole group's samples returning one reward each (sync or async; module:function
    or file.py:function). Used instead of `reward` when set."""
    reward_key: str | None = None
    """When rewards are dicts: the entry trained on (the whole dict stays in Sample.reward_info)."""
    reward_post_process: str | None = None
    """A function over all the kept samples of a rollout, run after scoring: it changes sample.reward in
    place or returns the new rewards (module:function or file.py:function)."""
    reward_timeout_s: float = Field(60.0, gt=0)
    """Longest wait for one group's rewards (a reward server's answer, or the group's reward functions)."""
    reward_retries: int = Field(2, ge=0)
    """Retries of a reward server request after a connection error, a timeout, a 429 or a 5xx."""
    dynamic_filter: str | None = None
    """Keep only groups this filter passes (DAPO's dynamic sampling: `nonzero_reward_std`), or a
    module:function / file.py:function of one group returning a bool or (bool, reason). More groups are
    started until prompts_per_rollout pass. None: every group is kept."""
    custom_generate_fn: str | None = None
    """Your own generation of each sample (multi-turn, tools, agents): a module:function or
    file.py:function ``async def generate(ctx, sample, sampling_params[, evaluation]) -> Sample |
    list[Sample]`` (slime's custom generate function; tether/rollout/generate_fn.py). A data row's
    metadata "generate_fn" overrides it for that row. None: one /generate call per sample."""
    environment: Environment | None = None
    """An environment from another library generates each sample (TRL environment classes, skyrl-gym),
    keyed on its ``type`` (docs/environments.md); instead of custom_generate_fn."""
    custom_rollout_fn: str | None = None
    """Your own rollout step: a module:function or file.py:function ``[async] def rollout(ctx, rollout_id,
    data_source, evaluation=False) -> list[list[Sample]] | RolloutOutput`` returning the groups to train
    on (slime's rollout function; tether/rollout/rollout_fn.py). Eval sets use it too when it takes
    ``evaluation``. None: the built-in rollout (streaming, dynamic filter, partial rollout)."""
    over_sampling_groups: int | None = Field(None, ge=1)
    """Groups started at the beginning of a rollout, at least prompts_per_rollout (None: exactly that);
    as groups are dropped, more start, up to this many not dropped at a time."""
    max_concurrent_groups: int | None = Field(None, ge=1)
    """Most groups generating at once. None: over_sampling_groups."""
    groups_per_request: int = Field(1, ge=1)
    """Groups started together go to an engine in requests of up to this many groups; a request's
    groups finish, are scored and are judged by the filter together. 1: every group is scored as
    soon as it finishes. On a CPU engine each request costs a few ms of HTTP handling that competes
    with decoding, which shows when responses are short (see docs/performance.md, against TRL).
    With a custom generate function, groups go one by one."""
    partial_rollout: bool = False
    """Groups still generating when a rollout has its groups (with over-sampling) are aborted but kept,
    with what they generated, and continued first by the next rollout (tether/rollout/buffer.py)."""
    keep_order: Literal["start", "finish"] = "start"
    """Which prompts_per_rollout groups a rollout keeps. start: the first to pass the filter in the
    order they started (the kept set and the data position depend only on each group's own samples).
    finish: the first to finish and pass (slime's way): with over_sampling_groups above
    prompts_per_rollout a long tail is cut short and continued by the next rollout. Needs
    partial_rollout (so no aborted group is lost) and deterministic: false."""
    mask_offpolicy_partial: bool = False
    """With partial_rollout: leave the tokens a continued response got from older weights out of the loss."""
    schedule: Schedule = SyncSchedule()
    """How generation and training take turns: ``mode`` picks the loop (sync, one_step_off, fully_async)
    and its settings come with it (docs/async.md)."""
    failures: FailuresConfig = FailuresConfig()
    """Retries, masking and budgets for samples whose generation, tools, environment or reward fail,
    and the stall watchdog (docs/failures.md)."""
    on_data_exhausted: Literal["train_on_passed", "fail"] = "train_on_passed"
    """When the epoch's prompts run out before prompts_per_rollout groups pass the filter: train on the
    groups that passed (with a warning), or stop the run with an error."""
    overlong_buffer_len: int | None = Field(None, ge=1)
    """DAPO overlong shaping: responses longer than max_response_len - overlong_buffer_len lose up to
    overlong_penalty_factor of reward, linearly (tether/rewards/shaping.py). None: off."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    """The largest overlong penalty (reached at max_response_len)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, raw: Any) -> Any:
        moved = _moved_fields(raw) if isinstance(raw, dict) else None
        if moved:
            raise ValueError(moved)
        schedule = raw.get("schedule") if isinstance(raw, dict) else None
        if isinstance(schedule, dict) and "mode" not in schedule:
            raise ValueError("rollout.schedule needs its mode: sync, one_step_off or fully_async")
        return raw

    @model_validator(mode="after")
    def _over_sampling(self) -> RolloutConfig:
        if self.over_sampling_groups is not None and self.over_sampling_groups < self.prompts_per_rollout:
            raise ValueError(f"rollout.over_sampling_groups ({self.over_sampling_groups}) must be at least "
                             f"rollout.prompts_per_rollout ({self.prompts_per_rollout})")
        if self.keep_order == "finish" and not self.partial_rollout:
            raise ValueError("rollout.keep_order: finish needs rollout.partial_rollout: true (the groups cut "
                             "short between kept ones are continued by the next rollout, not lost)")
        if self.environment is not None and self.custom_generate_fn:
            raise ValueError("rollout.environment and rollout.custom_generate_fn both generate the samples: set one")
        if self.custom_rollout_fn and self.partial_rollout:
            raise ValueError("rollout.partial_rollout is the built-in rollout's; with rollout.custom_rollout_fn, "
                             "hand unfinished groups back with data_source.add_samples(groups)")
        return self

    @property
    def groups_to_start(self) -> int:
        return self.over_sampling_groups or self.prompts_per_rollout


def generate_fn_spec(r: RolloutConfig) -> str | None:
    """The run's generate function: the user's, the environment's, or None (the built-in path)."""
    if r.environment is not None:
        from tether.envs.config import GENERATE_FN

        return GENERATE_FN[r.environment.type]
    return r.custom_generate_fn
