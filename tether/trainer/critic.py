"""PPO's critic: a value model beside the policy on the same ranks, with its own optimizer.

The value model is the policy's checkpoint with a one-output head per position (HF's
``AutoModelForTokenClassification``, head initialised to zero so the first values are 0), sharded
with FSDP2 like the policy. V at position j is the value of the state that ends with token j:
the same positions that score response tokens in the policy, so values line up with log-probs.

Per rollout: ``values`` (no grad) before the update feeds GAE; then each optimizer step
accumulates the clipped value loss over the same micro-batches as the policy and steps the
critic's own AdamW and schedule. It is checkpointed with the trainer (checkpoint.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel

from tether.algorithms.aggregation import GlobalCounts, aggregation_weights
from tether.algorithms.losses import value_loss
from tether.trainer.batch import MicroBatch, TrainBatch
from tether.trainer.head import model_inputs
from tether.config import TetherConfig
from tether.models.hf import DTYPES
from tether.trainer.model import prepare_for_training
from tether.trainer.optim import build_optimizer, build_scheduler
from tether.trainer.step import RLInputs, StepSettings, grad_norm, micro_batches, place


def load_value_model(path: str, dtype: str, device: str = "cpu") -> PreTrainedModel:
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # values are regression targets: no dropout noise
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=DTYPES[dtype],
                                                            attn_implementation="sdpa")
    head = model.score
    nn.init.zeros_(head.weight)
    if head.bias is not None:
        nn.init.zeros_(head.bias)
    return model.to(device)


class Critic:
    def __init__(self, cfg: TetherConfig, device: str, mesh, total_steps: int):
        self.model = prepare_for_training(load_value_model(cfg.model.path, cfg.model.dtype, device), cfg, mesh, device)
        train = cfg.train.model_copy(update={"lr": cfg.critic.lr, "min_lr": min(cfg.train.min_lr, cfg.critic.lr)})
        self.optimizer = build_optimizer(self.model, train)
        self.scheduler = build_scheduler(self.optimizer, train, total_steps)
        self.value_clip = cfg.critic.value_clip
        self.grad_clip = cfg.critic.grad_clip

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        """V at each position that scores a next token, in the micro-batch's output layout ([B, L-1] or [1, N])."""
        out = self.model(**model_inputs(self.model, mb))
        return mb.at_predictions(out.logits[..., 0]).float()

    @torch.no_grad()
    def values(self, batch: TrainBatch, steps: list[list[int]], s: StepSettings) -> dict[int, torch.Tensor]:
        """{sample: [R]} values of this rank's samples, batched as the policy's passes are."""
        self.model.eval()
        out: dict[int, torch.Tensor] = {}
        for mine in steps:
            for mb in micro_batches(batch, mine, s):
                values = self.forward(mb)
                for (row, start), i in zip(mb.spans, mb.indices):
                    out[i] = values[row, start : start + batch.response_lengths[i]].clone()
        return out

    def backward(self, batch: TrainBatch, mine: list[int], counts: GlobalCounts, s: StepSettings,
                 inputs: RLInputs, world: int) -> dict[str, float]:
        """Accumulate the clipped value loss (token mean over the global batch) on this rank."""
        old_values, returns = inputs.values, inputs.returns
        # This objective gave the values, so the estimator (GAE) gave returns with them.
        assert old_values is not None and returns is not None
        self.model.train()
        metrics: dict[str, float] = {}
        for mb in micro_batches(batch, mine, s):
            assert mb.seq_index is not None  # collate and collate_packed set it
            weights = aggregation_weights("token_mean", mb.response_mask, mb.seq_index, counts)
            loss, parts = value_loss(self.forward(mb), place(mb, batch, old_values), place(mb, batch, returns),
                                     mb.response_mask, weights, self.value_clip)
            (loss * world).backward()  # FSDP averages over ranks; the normaliser is already global
            for key, value in parts.items():
                metrics[f"critic/{key}"] = metrics.get(f"critic/{key}", 0.0) + value
        return metrics

    def step(self, apply: bool = True) -> dict[str, float]:
        """Clip and apply the accumulated gradients; returns the grad norm. ``apply=False``: the
        policy's step was skipped as non-finite, so the critic's is dropped too."""
        norm = grad_norm(self.model, self.grad_clip)
        if apply:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"critic/grad_norm": norm}
