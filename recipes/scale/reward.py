"""The scale recipe's reward: dense, so a random-weights model gets varied rewards and nonzero advantages."""


def digit_fraction(sample) -> float:
    """Fraction of the response's characters that are digits."""
    text = sample.response_text
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0
