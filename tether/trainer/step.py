"""One training iteration on a rank's share of a TrainBatch, as plain functions over a model.

Order (per rollout), ``train_steps`` on a TrainState: ``prepare_rl_inputs`` (log-probs of the rollout
tokens under the current policy, "old", before any update, when a separate pass is needed; the
reference model's; values from the objectives beside the policy; advantages of the whole batch,
identical on every rank) -> one or more optimizer steps over global batches, each accumulated over
micro-batches, the policy's loss and each objective's (the critic's; none for GRPO and SFT).

Normalisation: a loss is a token sum divided by the number of response tokens of the *global*
batch (all micro-batches, all ranks), so accumulation over k micro-batches on r ranks gives the
gradient of one big batch. FSDP averages gradients over ranks, so the loss is scaled by the world
size before backward to turn that average back into the sum.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tether.algorithms.advantages import AdvantageInputs, AdvantageParams, get_advantage_estimator
from tether.algorithms.aggregation import GlobalCounts, aggregation_weights
from tether.algorithms.distill import as_tensors, distill_advantages
from tether.algorithms.kl import kl_estimate
from tether.algorithms.names import TOKEN_LEVEL
from tether.algorithms.losses import LossInputs, LossParams, policy_objective
from tether.models.lora import adapters_disabled
from tether.trainer.batch import MicroBatch, TrainBatch, collate, collate_packed, split_micro_batches
from tether.trainer import mismatch, no_signal, shared_prefix
from tether.trainer.head import chunk_tokens, chunked_forward, chunked_head_agrees, plain_forward
from tether.trainer.micro_batches import balance_by_tokens, count_by_budget
from tether.trainer.nonfinite import NonFiniteGuard, check_weights

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class StepSettings:
    micro_batch_size: int
    global_batch_size: int
    pad_id: int
    grad_clip: float
    policy_loss: str
    loss_params: LossParams
    advantage_estimator: str
    advantage_params: AdvantageParams = field(default_factory=AdvantageParams)
    kl_in_reward_type: str = "k1"
    loss_agg_mode: str = "token_mean"
    max_response_len: int = 1
    """The constant normaliser of loss_agg_mode seq_mean_token_sum_norm."""
    max_tokens_per_micro_batch: int | None = None
    """Pack samples without padding into micro-batches of about this many tokens (micro_batches.py);
    None: micro_batch_size right-padded samples each."""
    logits_chunk_mb: float = 256.0
    """Log-probs from the LM head in chunks of about this many MB of float32 logits, at response positions
    only (trainer/head.py); 0: the model's whole logits at once."""
    teacher_advantage_coef: float = 0.0
    """teacher.mode advantage: the weight of (teacher - rollout log-prob) in each token's advantage."""
    share_prompts: bool = False
    """Samples that begin alike (a group's prompt) laid out so the common tokens are computed once
    (trainer/shared_prefix.py); a group stays on one rank and in one micro-batch where it fits."""
    device: str = "cpu"
    """Where the model runs: micro-batches are moved there."""
    max_unit_tokens: int | None = None
    """With share_prompts: the most tokens one group's row may take (a larger group is split, each part
    sharing the prompt), since dense attention costs a row's width squared; None: no limit."""


def assign_ranks(batch: TrainBatch, global_idx: list[int], s: StepSettings, rank: int, world: int) -> list[int]:
    """This rank's samples of one optimizer step: whole groups balanced by tokens when sharing prompts,
    balanced by tokens when packing, else strided."""
    if s.share_prompts:
        units = shared_prefix.split_to(_units(batch, global_idx, s), batch, world)
        parts = balance_by_tokens(list(range(len(units))), [u.length(batch) for u in units], world)[rank]
        return sorted(i for u in parts for i in units[u].members)
    if s.max_tokens_per_micro_batch is None:
        return global_idx[rank::world]
    return balance_by_tokens(global_idx, [len(t) for t in batch.tokens], world)[rank]


def _units(batch: TrainBatch, indices: list[int], s: StepSettings) -> list[shared_prefix.Unit]:
    budget = s.max_tokens_per_micro_batch
    cap = min(budget, s.max_unit_tokens or budget) if budget is not None else s.max_unit_tokens
    return shared_prefix.plan_units(batch, indices, s.micro_batch_size if budget is None else None, cap)


def micro_batches(batch: TrainBatch, mine: list[int], s: StepSettings) -> list[MicroBatch]:
    """This rank's micro-batches over ``mine``, on the model's device; with packing or shared prompts,
    as many as the busiest rank needs."""
    if s.share_prompts:
        mbs = _shared_micro_batches(batch, mine, s)
    elif s.max_tokens_per_micro_batch is None:
        mbs = [collate(batch, chunk, s.pad_id) for chunk in split_micro_batches(mine, s.micro_batch_size)]
        # Ranks differ in count when samples without signal were left out (no_signal.py): FSDP needs the same.
        mbs += [collate_packed(batch, [], s.pad_id) for _ in range(int(all_reduce_max(float(len(mbs)))) - len(mbs))]
    else:
        lengths = [len(t) for t in batch.tokens]
        count = int(all_reduce_max(float(count_by_budget(mine, lengths, s.max_tokens_per_micro_batch))))
        mbs = [collate_packed(batch, chunk, s.pad_id) for chunk in balance_by_tokens(mine, lengths, count)]
    return [mb.to(s.device) for mb in mbs]


def _shared_micro_batches(batch: TrainBatch, mine: list[int], s: StepSettings) -> list[MicroBatch]:
    """Whole units per micro-batch: up to micro_batch_size samples, or about max_tokens_per_micro_batch
    tokens; a micro-batch with nothing shared takes the plain layout."""
    units = _units(batch, mine, s)
    lengths = [u.length(batch) for u in units]
    plan: list[list[int]] = []
    if s.max_tokens_per_micro_batch is None:
        for u, unit in enumerate(units):
            if not plan or sum(len(units[v].members) for v in plan[-1]) + len(unit.members) > s.micro_batch_size:
                plan.append([])
            plan[-1].append(u)
    elif units:
        plan = balance_by_tokens(list(range(len(units))), lengths,
                                 count_by_budget(list(range(len(units))), lengths, s.max_tokens_per_micro_batch))
    # FSDP runs collectives in every forward and backward: every rank runs the busiest rank's count.
    plan += [[] for _ in range(int(all_reduce_max(float(len(plan)))) - len(plan))]
    out = []
    for chunk in plan:
        picked = [units[u] for u in chunk]
        samples = [i for unit in picked for i in unit.members]
        if shared_prefix.shares_anything(picked):
            out.append(shared_prefix.collate_shared(batch, picked, s.pad_id))
        elif s.max_tokens_per_micro_batch is None and samples:
            out.append(collate(batch, samples, s.pad_id))
        else:
            out.append(collate_packed(batch, samples, s.pad_id))  # an empty one runs as a no-op
    return out


def forward_logprobs(model: PreTrainedModel, mb: MicroBatch, temperature: float, entropy: str = "none",
                     chunk_mb: float = 256.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position log-probs of the next token ([B, L-1]) and the entropy there.

    entropy: "grad" (it is optimised), "metric" (logged only: computed without a graph), "none".
    chunk_mb > 0: computed at response positions only, a chunk of tokens at a time (trainer/head.py; 0
    at other positions); 0: from the model's whole logits.
    """
    if chunk_mb > 0 and chunked_head_agrees(model):
        return chunked_forward(model, mb, temperature, entropy, chunk_tokens(model, chunk_mb))
    return plain_forward(model, mb, temperature, entropy)


@torch.no_grad()
def response_logprobs(model: PreTrainedModel, batch: TrainBatch, steps: list[list[int]],
                      s: StepSettings) -> dict[int, torch.Tensor]:
    """Log-probs of each sample's response tokens under ``model`` (no grad): {sample index: [R]}.

    steps: this rank's samples per optimizer step, batched exactly as the training passes are.
    """
    out: dict[int, torch.Tensor] = {}
    for mine in steps:
        for mb in micro_batches(batch, mine, s):
            logprobs, _ = forward_logprobs(model, mb, batch.temperature, chunk_mb=s.logits_chunk_mb)
            for (row, start), i in zip(mb.spans, mb.indices):
                out[i] = logprobs[row, start : start + batch.response_lengths[i]].clone()
    return out


def place(mb: MicroBatch, batch: TrainBatch, per_sample: dict[int, torch.Tensor]) -> torch.Tensor:
    """Scatter per-sample response values ([R] each) into the micro-batch's [B, L-1] layout."""
    out = torch.zeros_like(mb.response_mask)
    for (row, start), i in zip(mb.spans, mb.indices):
        out[row, start : start + batch.response_lengths[i]] = per_sample[i]
    return out


def gather_per_sample(local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank's {sample: tensor} merged (each rank computed its own samples)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return dict(local)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {i: t for part in parts for i, t in part.items()}


def padded(per_sample: dict[int, torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """[N, T] with sample i's [R_i] values left-aligned in row i."""
    out = torch.zeros(len(lengths), max(lengths, default=0) or 1)
    for i, length in enumerate(lengths):
        out[i, :length] = per_sample[i][:length]
    return out


def compute_advantages(batch: TrainBatch, s: StepSettings, old: dict[int, torch.Tensor] | None,
                       ref: dict[int, torch.Tensor] | None, values: dict[int, torch.Tensor] | None = None):
    """Per-token advantages {sample: [R]} of the whole batch (identical on every rank), the value
    targets {sample: [R]} when there is a critic (else None), and metrics.

    The estimators see only the trained tokens of each response, left-aligned (a tool's output in
    the middle of a response is skipped, so returns flow from one policy token to the next and the
    outcome reward sits on the last policy token); the results go back to their positions, 0 on
    masked tokens. ``old`` and ``ref`` are needed (not None) with a KL penalty in the reward."""
    keep = [torch.tensor(batch.loss_mask(i), dtype=torch.bool) for i in range(len(batch))]
    if batch.trajectories is not None:
        return trajectory_advantages(batch, s, keep)
    lengths = [int(k.sum()) for k in keep]
    mask = padded({i: torch.ones(r) for i, r in enumerate(lengths)}, lengths)
    kl = None
    if s.advantage_params.kl_coef > 0:
        # KL(policy || reference) of the rollout tokens, per token, for the penalty in the reward.
        # prepare_rl_inputs runs the old pass for it, and the config's needs_ref_model the reference.
        assert old is not None and ref is not None
        old_all, ref_all = gather_per_sample(old), gather_per_sample(ref)
        kl = padded({i: kl_estimate(old_all[i][keep[i]], ref_all[i][keep[i]], s.kl_in_reward_type)
                     for i in old_all}, lengths)
    value_rows = None
    if values is not None:
        value_rows = padded({i: v[keep[i]] for i, v in gather_per_sample(values).items()}, lengths)
    excluded = None if batch.excluded is None else torch.tensor(batch.excluded, dtype=torch.bool)
    inputs = AdvantageInputs(torch.tensor(batch.rewards, dtype=torch.float32), mask, batch.group_size, kl=kl,
                             values=value_rows, excluded=excluded)
    result, metrics = get_advantage_estimator(s.advantage_estimator)(inputs, s.advantage_params)

    def spread(rows: torch.Tensor) -> dict[int, torch.Tensor]:
        out = {i: torch.zeros(len(k)) for i, k in enumerate(keep)}
        for i, k in enumerate(keep):
            out[i][k] = rows[i, : lengths[i]]
        return out

    returns = None if result.returns is None else spread(result.returns)
    return spread(result.advantages), returns, metrics


def trajectory_advantages(batch: TrainBatch, s: StepSettings, keep: list[torch.Tensor]):
    """Advantages of a batch with segments: the estimator sees one reward per trajectory (its last
    counted segment's; a trajectory whose every segment is excluded counts in no statistic), and every
    trained token of every segment gets its trajectory's advantage. Outcome estimators only: a
    token-level one (or a KL penalty in the reward) has no meaning across segments."""
    if s.advantage_estimator in TOKEN_LEVEL or s.advantage_params.kl_coef > 0:
        raise ValueError(f"algorithm.advantage_estimator {s.advantage_estimator!r}"
                         + (" with a KL penalty in the reward" if s.advantage_params.kl_coef > 0 else "")
                         + " works per token; a rollout whose samples are segments of trajectories needs an "
                           "outcome estimator (grpo, dr_grpo, rloo, gspo)")
    assert batch.trajectories is not None and batch.rewards is not None
    n = batch.trajectories[-1] + 1
    rewards, excluded = [0.0] * n, [True] * n
    for i, t in enumerate(batch.trajectories):
        if batch.excluded is None or not batch.excluded[i]:
            rewards[t], excluded[t] = batch.rewards[i], False
    inputs = AdvantageInputs(torch.tensor(rewards, dtype=torch.float32), torch.ones(n, 1), batch.group_size,
                             excluded=torch.tensor(excluded) if any(excluded) else None)
    result, metrics = get_advantage_estimator(s.advantage_estimator)(inputs, s.advantage_params)
    per = result.advantages[:, 0]
    return {i: per[t] * k.float() for i, (t, k) in enumerate(zip(batch.trajectories, keep))}, None, metrics


def token_abs_diffs(batch: TrainBatch, indices: list[int], old: dict[int, torch.Tensor]) -> torch.Tensor:
    """|trainer - engine| log-prob of every trained response token of this rank's samples, flat."""
    parts = [torch.zeros(0)]
    engine = batch.rollout_logprobs
    for i in indices:
        if batch.response_lengths[i] == 0:
            continue
        if engine is None:
            raise ValueError(f"the batch has no rollout_logprobs (sample {i} has a response): the trainer's "
                             "log-probs are compared with the engine's")
        keep = torch.tensor(batch.loss_mask(i), dtype=torch.bool)
        # On the CPU: the engine's log-probs live there, and the histogram is built there.
        trainer = old[i].detach().float().cpu()
        parts.append((trainer - torch.tensor(engine[i], dtype=torch.float32))[keep].abs())
    return torch.cat(parts)


def logprob_mismatch(batch: TrainBatch, indices: list[int], old: dict[int, torch.Tensor]) -> tuple[float, float, float]:
    """(sum |trainer - engine| over trained response tokens, token count, max) for this rank's samples."""
    diff = token_abs_diffs(batch, indices, old)
    return float(diff.sum()), float(diff.numel()), float(diff.max()) if diff.numel() else 0.0


def mismatch_metrics(batch: TrainBatch, indices: list[int], old: dict[int, torch.Tensor]) -> dict[str, float]:
    """Mean, max, p50, p99 and share over 0.1 of |diff| over the whole batch on all ranks: the summary
    vector (mismatch.py) is summed in one all-reduce of O(bins) floats, the max in another."""
    diff = token_abs_diffs(batch, indices, old)
    summary = torch.tensor(all_reduce_sum(mismatch.summarize(diff).tolist()), dtype=torch.float64)
    return mismatch.metrics(summary, all_reduce_max(float(diff.max()) if diff.numel() else 0.0))


def grad_norm(model: nn.Module, grad_clip: float) -> float:
    """The global grad norm, clipping the gradients to ``grad_clip`` (0: only measured)."""
    # clip_grad_norm_ reduces the norm over all shards; max_norm=inf only measures it.
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def accumulate(metrics: dict[str, float], new: dict[str, float]) -> None:
    for key, value in new.items():
        metrics[key] = metrics.get(key, 0.0) + float(value)


def run_global_step(model, batch: TrainBatch, mine: list[int], counts: GlobalCounts, s: StepSettings,
                    advantages: dict[int, torch.Tensor] | None, old: dict[int, torch.Tensor] | None,
                    ref: dict[int, torch.Tensor] | None, world: int,
                    seen: dict[int, torch.Tensor] | None = None,
                    teacher: dict[int, torch.Tensor] | None = None) -> dict[str, float]:
    """Forward/backward over this rank's micro-batches of one global batch (no optimizer step).

    ``old`` None: the old log-probs are this forward's, detached (the policy has not moved yet), and
    ``seen``, when given, receives them per sample ([R] each), as ``response_logprobs`` would return."""
    metrics: dict[str, float] = {}
    # Entropy is logged even when it is not optimised: its collapse is the first thing to look at.
    entropy_mode = "grad" if s.loss_params.entropy_coef > 0 else "metric"
    for mb in micro_batches(batch, mine, s):
        assert mb.seq_index is not None  # collate and collate_packed set it
        logprobs, entropy = forward_logprobs(model, mb, batch.temperature, entropy_mode, s.logits_chunk_mb)
        if seen is not None:
            for (row, start), i in zip(mb.spans, mb.indices):
                seen[i] = logprobs[row, start : start + batch.response_lengths[i]].detach().clone()
        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=place(mb, batch, old) if old is not None else logprobs.detach(),
            advantages=place(mb, batch, advantages) if advantages is not None else torch.zeros_like(logprobs),
            mask=mb.response_mask,
            num_tokens=counts.num_tokens,
            ref_logprobs=place(mb, batch, ref) if ref is not None else None,
            entropy=entropy,
            loss_weights=aggregation_weights(s.loss_agg_mode, mb.response_mask, mb.seq_index, counts),
            seq_index=mb.seq_index,
            rollout_logprobs=mb.rollout_logprobs if batch.rollout_logprobs is not None else None,
            teacher_logprobs=place(mb, batch, teacher) if teacher is not None else None,
        )
        loss, parts = policy_objective(inputs, s.loss_params, s.policy_loss)
        (loss * world).backward()
        accumulate(metrics, parts)
    return metrics


@contextmanager
def timed(totals: dict[str, float], phase: str) -> Iterator[None]:
    """Adds the block's wall time to totals["timing/train_<phase>_s"] (summed over optimizer steps)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing/train_{phase}_s"
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - start


def all_reduce_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


class Objective(Protocol):
    """A model trained beside the policy on each RL batch, from the same micro-batches: the critic of
    PPO with GAE. GRPO, the other estimators and SFT have none (an empty list)."""

    def values(self, batch: TrainBatch, steps: list[list[int]], s: StepSettings) -> dict[int, torch.Tensor] | None:
        """Per-sample values the advantages need, before any update (None: it gives none)."""
        ...

    def backward(self, batch: TrainBatch, mine: list[int], counts: GlobalCounts, s: StepSettings,
                 inputs: RLInputs, world: int) -> dict[str, float]:
        """Accumulate its loss over this rank's micro-batches of one optimizer step."""
        ...

    def step(self, apply: bool) -> dict[str, float]:
        """Its optimizer step (dropped when the policy's was skipped as non-finite); metrics."""
        ...


@dataclass
class TrainState:
    """What one train call works on: the policy and its optimizer, and what trains or scores beside it."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref_model: PreTrainedModel | None = None
    """The frozen reference policy (KL), when the config asks for one: a LoRA run's policy model itself,
    run with its adapters off."""
    objectives: list[Objective] = field(default_factory=list)
    guard: NonFiniteGuard = field(default_factory=lambda: NonFiniteGuard(0))
    """Counts non-finite steps across calls."""


@dataclass
class RLInputs:
    """An RL batch's per-sample inputs to the loss ({sample index: [R]} each), prepared before any update."""

    advantages: dict[int, torch.Tensor]
    returns: dict[int, torch.Tensor] | None = None
    """Value targets, when an objective gave values."""
    old: dict[int, torch.Tensor] | None = None
    """Log-probs under the policy before the update, when a separate pass computed them; else the
    first optimizer step's own forward fills ``seen`` with them."""
    ref: dict[int, torch.Tensor] | None = None
    values: dict[int, torch.Tensor] | None = None
    seen: dict[int, torch.Tensor] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    teacher: dict[int, torch.Tensor] | None = None
    """A distillation teacher's log-probs, when the batch has them (the loss's teacher term)."""


def prepare_rl_inputs(state: TrainState, batch: TrainBatch, s: StepSettings, assigned: list[list[int]],
                      phases: dict[str, float]) -> RLInputs:
    """Old and reference log-probs (when needed), values and advantages of the whole batch."""
    steps = len(assigned)
    # With one optimizer step per rollout, the old log-probs are the training forward's own (detached):
    # the policy has not moved before that step, and the passes are batched alike, so they are the same
    # numbers a separate pass would compute. Only a KL penalty in the reward needs them before training.
    separate_old = steps > 1 or s.advantage_params.kl_coef > 0
    old = ref = values = None
    if separate_old:
        with timed(phases, "old_logprob"):
            old = response_logprobs(state.model, batch, assigned, s)
    if state.ref_model is not None:
        # A LoRA run's reference is the policy itself with its adapters off; a separate model has none.
        with timed(phases, "ref_logprob"), adapters_disabled(state.ref_model):
            ref = response_logprobs(state.ref_model, batch, assigned, s)
    with timed(phases, "advantages"):
        for objective in state.objectives:
            given = objective.values(batch, assigned, s)
            values = given if given is not None else values
        advantages, returns, adv_metrics = compute_advantages(batch, s, old, ref, values)
    metrics = {f"train/adv_{k.removeprefix('adv_')}": v for k, v in adv_metrics.items()}
    metrics["train/separate_old_logprob_pass"] = float(separate_old)
    teacher = None
    if batch.teacher_logprobs is not None:
        teacher = as_tensors(batch.teacher_logprobs)
        # The student's side is the rollout's log-probs: the policy that sampled the tokens.
        student = as_tensors(batch.rollout_logprobs or [[0.0] * n for n in batch.response_lengths])
        masks = {i: torch.tensor(batch.loss_mask(i), dtype=torch.float32) for i in range(len(batch))}
        distilled, distill_metrics = distill_advantages(advantages, student, teacher, masks, s.teacher_advantage_coef)
        if s.teacher_advantage_coef > 0:
            advantages = distilled
        metrics.update({f"train/{k}": v for k, v in distill_metrics.items()})
    return RLInputs(advantages, returns, old, ref, values, None if separate_old else {}, metrics, teacher)


def optimizer_steps(batch: TrainBatch, global_batch_size: int) -> list[list[int]]:
    """The samples of each optimizer step: global_batch_size of them, or of trajectories when the batch
    has segments (TrainBatch.trajectories), so that a trajectory's segments take one step together."""
    t = batch.trajectories
    n = len(batch) if t is None else t[-1] + 1
    what = "samples" if t is None else "trajectories"
    if n % global_batch_size:
        raise ValueError(f"batch of {n} {what} is not a multiple of global_batch_size={global_batch_size}")
    if t is None:
        return [list(range(k * global_batch_size, (k + 1) * global_batch_size)) for k in range(n // global_batch_size)]
    steps: list[list[int]] = [[] for _ in range(n // global_batch_size)]
    for i, trajectory in enumerate(t):
        steps[trajectory // global_batch_size].append(i)
    return steps


def train_steps(state: TrainState, batch: TrainBatch, s: StepSettings, rank: int, world: int,
                what: str = "train") -> dict:
    """All optimizer steps of one rollout (or one SFT batch) on this rank; returns global metrics
    (and "warnings" for skipped non-finite steps). ``what`` names the batch in messages."""
    batch.validate()
    global_steps = optimizer_steps(batch, s.global_batch_size)
    steps = len(global_steps)
    assigned = [assign_ranks(batch, idx, s, rank, world) for idx in global_steps]
    phases: dict[str, float] = {}  # where this rank's time went: old/ref passes, forward/backward, optimizer
    rl = prepare_rl_inputs(state, batch, s, assigned, phases) if batch.rewards is not None else None
    out: dict[str, Any] = dict(rl.metrics) if rl is not None else {}  # floats, and "warnings" (a list)
    summed: dict[str, float] = {}
    warnings: list[str] = []
    idle = _without_signal(batch, rl, s, global_steps)
    if idle:
        out["train/no_signal_frac"] = len(idle) / len(batch)
        # Nothing is held per rank yet (old, reference or critic values): balance what runs over the ranks.
        if rl is not None and rl.old is None and rl.ref is None and not state.objectives:
            assigned = [assign_ranks(batch, [i for i in idx if i not in idle], s, rank, world) for idx in global_steps]
    for k, (global_idx, mine) in enumerate(zip(global_steps, assigned)):
        trained = [batch.trained_tokens(i) for i in global_idx]
        counts = GlobalCounts(num_tokens=float(max(1, sum(trained))), num_sequences=float(max(1, sum(t > 0 for t in trained))),
                              max_response_len=max(1, s.max_response_len))
        ran = sum(t for i, t in zip(global_idx, trained) if i not in idle)
        with timed(phases, "forward_backward"):
            parts = run_global_step(state.model, batch, [i for i in mine if i not in idle], counts, s,
                                    rl.advantages if rl else None, rl.old if rl else None, rl.ref if rl else None,
                                    world, rl.seen if rl else None, rl.teacher if rl else None)
        parts = no_signal.rescale_means(parts, counts.num_tokens, float(ran))
        if rl is not None and k == 0:  # the trainer's log-probs before any update, against the engine's
            # Without a separate old pass, step 0's forward has just filled ``seen`` (prepare_rl_inputs).
            old = rl.old if rl.old is not None else rl.seen
            assert old is not None
            out.update(mismatch_metrics(batch, [i for m in assigned for i in m if i in old], old))
        if rl is not None:
            for objective in state.objectives:
                with timed(phases, "critic"):
                    parts.update(objective.backward(batch, mine, counts, s, rl, world))
        skipped = _optimizer_step(state, batch, rl, mine, parts, s, f"{what}, optimizer step {k + 1}/{steps}", phases)
        if skipped is not None:
            warnings.append(skipped)
        accumulate(summed, parts)
    check_weights(state.model, what)
    out.update({f"train/{k}": v / steps for k, v in summed.items()})
    out.update(phases)
    out["train/optimizer_steps"] = float(steps - len(warnings))
    out["train/skipped_steps"] = float(len(warnings))
    if warnings:
        out["warnings"] = warnings
    return out


def _without_signal(batch: TrainBatch, rl: RLInputs | None, s: StepSettings, steps: list[list[int]]) -> set[int]:
    """Samples left out of the policy's forward and backward: zero advantages under a loss where they add
    nothing to the gradient (no_signal.py). An optimizer step keeps its shortest sample when none has
    signal: its backward gives the exact zero gradient the optimizer then steps on (Adam's moments and
    weight decay move the weights even then), with every parameter's gradient laid out as the model's."""
    if rl is None or not no_signal.applies(s.policy_loss, s.loss_params, rl.teacher is not None):
        return set()
    idle = no_signal.without_signal(rl.advantages, list(range(len(batch))))
    for idx in steps:
        if idle.issuperset(idx):
            keep = min((i for i in idx if batch.trained_tokens(i) > 0), key=batch.trained_tokens, default=None)
            idle -= set(idx) if keep is None else {keep}
    return idle


def _optimizer_step(state: TrainState, batch: TrainBatch, rl: RLInputs | None, mine: list[int],
                    parts: dict[str, float], s: StepSettings, where: str, phases: dict[str, float]) -> str | None:
    """Reduce this step's metrics over ranks into ``parts``, clip, check and step (policy, then the
    objectives); the warning when the step was skipped as non-finite, else None."""
    keys = sorted(parts)
    reduced = dict(zip(keys, all_reduce_sum([parts[key] for key in keys])))
    with timed(phases, "optimizer"):  # grad norm and clipping (a collective), the checks, the step
        norm = grad_norm(state.model, s.grad_clip)
        inputs = {"advantages": _cat(rl.advantages if rl else None, mine),
                  "old log-probs": _cat(rl.old if rl else None, mine),
                  "ref log-probs": _cat(rl.ref if rl else None, mine)}
        skipped = state.guard.check(where, reduced, norm, state.model, inputs)
        reduced["lr"] = state.optimizer.param_groups[0]["lr"]  # the rate this step uses
        reduced["grad_norm"] = norm
        if skipped is None:
            state.optimizer.step()
            state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
    if rl is not None:
        for objective in state.objectives:
            reduced.update(objective.step(apply=skipped is None))
    parts.clear()
    parts.update(reduced)
    return skipped


def train_on_batch(model, optimizer, scheduler, batch: TrainBatch, s: StepSettings, rank: int, world: int,
                   ref_model: PreTrainedModel | None = None, critic: Objective | None = None,
                   guard: NonFiniteGuard | None = None, what: str = "train") -> dict:
    """``train_steps`` on a state made of these parts (the critic, when given, as its one objective)."""
    state = TrainState(model, optimizer, scheduler, ref_model, [critic] if critic is not None else [],
                       guard or NonFiniteGuard(0))
    return train_steps(state, batch, s, rank, world, what)


def _cat(per_sample: dict[int, torch.Tensor] | None, indices: list[int]) -> torch.Tensor | None:
    """This rank's samples' values as one flat tensor (for finding where a NaN came from)."""
    if per_sample is None or not indices:
        return None
    return torch.cat([per_sample[i].flatten() for i in indices if i in per_sample] or [torch.zeros(0)])
