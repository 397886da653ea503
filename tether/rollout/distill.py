"""On-policy distillation's rollout side: the teacher (teacher.model, a served model) scores every token
each sample's policy generated, after the same prompt and earlier tokens, at the rollout's temperature.
The trainer turns the two sides' log-probs into advantages or a loss term (algorithms/distill.py,
losses.py); docs/distillation.md."""

from __future__ import annotations

from tether.config import TetherConfig
from tether.sample import Sample
from tether.served import MODELS


async def teacher_scores(cfg: TetherConfig, group: list[Sample]) -> None:
    """Fill ``teacher_logprobs`` of the group's samples that have response tokens and did not fail."""
    if cfg.teacher is None:
        return
    todo = [s for s in group if not s.failed and s.response_length > 0]
    for s in group:
        if not s.failed and s.response_length == 0:
            s.teacher_logprobs = []
    if not todo:
        return
    teacher = MODELS[cfg.teacher.model]
    scores = await teacher.score([s.prompt_ids + s.response_ids for s in todo], [len(s.prompt_ids) for s in todo],
                                 cfg.rollout.temperature)
    for sample, values in zip(todo, scores):
        sample.teacher_logprobs = values
