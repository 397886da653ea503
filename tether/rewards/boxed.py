"""The answer in the last \\boxed{...} of a text (the math reward's and the reasoning_gym reward's)."""

from __future__ import annotations

_BOXED = "\\boxed"


def extract_last_boxed(text: str) -> str | None:
    """Return the content of the last complete \\boxed{...} in `text`, or None.

    Braces are matched with a depth counter so nested groups such as
    \\boxed{\\frac{1}{2}} are kept whole; escaped braces (\\{ \\}) do not count.
    An unterminated last \\boxed{ is skipped in favour of an earlier complete one.
    """
    start = text.rfind(_BOXED)
    while start != -1:
        content = _braced_group(text, start + len(_BOXED))
        if content is not None:
            return content
        start = text.rfind(_BOXED, 0, start)
    return None


def _braced_group(text: str, pos: int) -> str | None:
    """Content of the {...} group starting at `pos` (after spaces), or None."""
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        return None
    depth = 0
    i = pos
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character, e.g. \{ or \}
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : i]
        i += 1
    return None
