"""The calculator_env recipe's reward: exact match of the final answer, the model's last turn (the text
after the last "assistant: " the chat template opened; the whole response when there was one turn).

    rollout: {reward: reward.py:score}
"""

from __future__ import annotations

TURN = "assistant: "


def score(response: str, label) -> float:
    return float(response.rpartition(TURN)[2].strip() == str(label).strip())
