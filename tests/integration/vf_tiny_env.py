"""A verifiers environment module, as verifiers users write one (loaded by vf.load_environment("vf-tiny-env")
in verifiers' own Python environment, by the verifiers tests)."""

import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 4, multi_turn: bool = False, **kwargs) -> vf.Environment:
    """n sums "k+1="; the rubric rewards a reply holding the answer, and counts the turns."""
    data = Dataset.from_list([{"question": f"{k}+1=", "answer": str(k + 1)} for k in range(n)])

    def has_answer(completion, answer, **kw) -> float:
        text = "".join(getattr(m, "content", None) or (m.get("content") if isinstance(m, dict) else "") or ""
                       for m in completion)
        return float(answer in text)

    def reply_length(completion, **kw) -> float:
        return float(sum(len(getattr(m, "content", None) or "") for m in completion))

    rubric = vf.Rubric(funcs=[has_answer, reply_length], weights=[1.0, 0.0])
    if not multi_turn:
        return vf.SingleTurnEnv(dataset=data, eval_dataset=data.select(range(2)), rubric=rubric)
    return Twice(dataset=data, max_turns=3, rubric=rubric)


class Twice(vf.MultiTurnEnv):
    """Asks again once, then ends."""

    async def setup_state(self, state):
        state["asked"] = 0
        return state

    async def env_response(self, messages, state, **kw):
        state["asked"] += 1
        if state["asked"] >= 2:
            state["final_env_response"] = [{"role": "user", "content": "ok"}]
            return state["final_env_response"]
        return [{"role": "user", "content": "again?"}]
