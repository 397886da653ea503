"""Incremental detokenization: the text of a growing list of token ids at the cost of a few tokens a step.

Decoding a response's whole token list after every token (to look for stop strings) costs O(length)
per token, O(length^2) per response, which real BPE tokenizers make noticeable. Instead each step
decodes a short window twice, the tokens since the last emitted text with and without the newest
ones, and appends the difference (vLLM and TGI detokenize the same way). The window starts at a
token boundary that was already decoded, so byte-level BPE pieces and SentencePiece's leading-space
marks come out as they do in a whole decode; while the newest token ends inside a multi-byte
character (the text ends in U+FFFD), nothing is emitted until the character is complete.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.text = ""
        self._prefix = 0  # window start: tokens before it are already in self.text
        self._read = 0  # tokens up to here are already in self.text

    def update(self, ids: list[int]) -> str:
        """The text ``ids`` (the previous ids plus new ones) adds to ``self.text``; appended there too."""
        before = self.decode(ids[self._prefix:self._read])
        now = self.decode(ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""  # nothing complete yet (a special token skipped, or half a character)
        if not now.startswith(before):  # a tokenizer that rewrites earlier text: decode it all once
            full = self.decode(ids)
            new = full[len(self.text):] if full.startswith(self.text) else ""
            self.text = full
        else:
            new = now[len(before):]
            self.text += new
        self._prefix, self._read = self._read, len(ids)
        return new
