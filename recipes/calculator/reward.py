"""The calculator recipe's reward: exact match of the final answer.

The final answer is the text after the last ``</result>`` (what the model wrote after the tool's last
answer), or the whole response when it made no call.

    rollout: {reward: reward.py:score}
"""

from __future__ import annotations

END_RESULT = "</result>"  # as agent.py inserts it (this file is loaded on its own, by path)


def final_answer(response: str) -> str:
    return response.rpartition(END_RESULT)[2].strip()


def score(response: str, label) -> float:
    return float(final_answer(response) == str(label).strip())
