"""On-policy distillation as a per-token advantage: the teacher's judgement of each token the student
sampled. Pure tensor math over {sample: [R]} dicts, as the trainer's RL inputs are kept.

With ``s_t = log pi_student(x_t)`` (the rollout's log-probs) and ``t_t = log pi_teacher(x_t)`` (the
teacher's, on the same tokens after the same prefix), ``s_t - t_t`` estimates the reverse KL
KL(student || teacher) at that token, and ``coef * (t_t - s_t)`` is added to the token's advantage: a
token the teacher finds likelier than the student did is pushed up, one it finds unlikely down. The
task reward's advantage stays beside it, so the two compose. (The loss form of the same KL is the
teacher term of losses.policy_objective.)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["distill_advantages"]


def distill_advantages(advantages: dict[int, Tensor], student: dict[int, Tensor], teacher: dict[int, Tensor],
                       masks: dict[int, Tensor], coef: float) -> tuple[dict[int, Tensor], dict[str, float]]:
    """``advantages`` plus ``coef * (teacher - student)`` on each sample's trained tokens (``masks``: 1
    trained, 0 not); metrics: the token mean of the reverse-KL estimate and of each side's log-probs."""
    out: dict[int, Tensor] = {}
    kl_sum = student_sum = teacher_sum = tokens = 0.0
    for i, adv in advantages.items():
        keep = masks[i] > 0  # untrained positions (a tool's tokens) may hold anything, NaN included
        zero = torch.zeros((), dtype=adv.dtype)
        gap = torch.where(keep, (teacher[i] - student[i]).to(adv.dtype), zero)
        out[i] = adv + coef * gap
        tokens += float(keep.sum())
        kl_sum -= float(gap.sum())
        student_sum += float(torch.where(keep, student[i].to(adv.dtype), zero).sum())
        teacher_sum += float(torch.where(keep, teacher[i].to(adv.dtype), zero).sum())
    n = max(tokens, 1.0)
    return out, {"teacher_kl": kl_sum / n, "teacher_logprob_mean": teacher_sum / n,
                 "student_logprob_mean": student_sum / n}


def as_tensors(rows: list[list[float]]) -> dict[int, Tensor]:
    return {i: torch.tensor(row, dtype=torch.float32) for i, row in enumerate(rows)}
