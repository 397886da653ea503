"""AdamW and the learning-rate schedule (linear warm-up, then constant or cosine)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tether.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        # foreach kernels do not take DTensors on every backend; the plain loop is fine at this size.
        foreach=False,
    )


def lr_multiplier(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Factor applied to cfg.lr at optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    # Cosine from lr to min_lr over the steps after warm-up.
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.min_lr / cfg.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))
