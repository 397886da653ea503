"""A user reward loaded by file path in the integration tests: dense, so a random model gets signal."""


def digit_fraction(sample) -> float:
    """Fraction of response characters that are digits."""
    text = sample.response_text
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def broken(sample) -> float:
    """A reward with a bug, to check how the failure is reported."""
    return {"answer": 1.0}[sample.response_text]


def constant_when_label_is_even(sample) -> float:
    """Every sample of a prompt with an even label scores 1 (a group the dynamic filter drops)."""
    return 1.0 if int(sample.label) % 2 == 0 else digit_fraction(sample)
