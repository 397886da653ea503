"""A user reward loaded by file path in the integration tests: dense, so a random model gets signal."""


def digit_fraction(sample) -> float:
    """Fraction of response characters that are digits."""
    text = sample.response_text
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def broken(sample) -> float:
    """A reward with a bug, to check how the failure is reported."""
    return {"answer": 1.0}[sample.response_text]
