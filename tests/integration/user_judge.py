"""Rewards scored by a served model (served_models: judge), as a user writes them: an LLM judge in a few lines."""


async def judge(sample, models) -> float:
    """A generative judge: the judge model's greedy four-token verdict on the exchange; the reward is the
    share of digits in it (a random judge has no opinions, but its verdicts are reproducible). The
    verdict is kept in the sample's metadata, which the rollout dump shows."""
    reply = await models["judge"].generate(sample.prompt + sample.response_text, {"max_new_tokens": 4, "temperature": 0.0})
    sample.metadata["verdict"] = reply["text"]
    return sum(c.isdigit() for c in reply["text"]) / 4


def judge_sync(response: str, label, models) -> float:
    """The same judge from a sync reward (tether runs it in a thread), through the chat route."""
    verdict = models["judge"].chat_sync(f"Is {response!r} equal to {label}?", max_tokens=4, temperature=0.0)
    return sum(c.isdigit() for c in verdict) / 4


def misnamed(sample, models) -> float:
    return models["juge"].generate_sync(sample.prompt)["text"].count("1")
