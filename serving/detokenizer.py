"""Incremental detokenization (docs/architecture.md#serving): a request's output text grown by
the tokens each step adds, not decoded again from its first token every step.

vLLM keeps two offsets into a request's tokens for the same reason (its incremental
detokenizer's ``prefix_offset`` and ``read_offset``); `IncrementalText` keeps the same two, and
works with any tokenizer's ``decode``: the text of the tokens before ``read`` is kept, and each
call decodes only the tokens from ``prefix`` on (the last ones kept, as context for tokenizers
that place spaces by their neighbours, and the new ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalText"]

_PARTIAL = "\ufffd"  # what decoding an incomplete UTF-8 character at the end gives


class IncrementalText:
    """``decode(ids)`` of a growing list of token ids, for the cost of decoding its last few.

    The kept text is ``decode(ids[:read])``, ending in a whole character. A call decodes
    ``ids[prefix:]`` and drops the text of ``ids[prefix:read]`` (the context) from its front: the
    rest is the new tail, kept once it ends in a whole character. A tokenizer whose window does
    not begin with its context's text is decoded whole from then on (correct, only slower).
    """

    __slots__ = ("_context", "_decode", "_exact", "_kept", "_prefix", "_read")

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._kept = ""  # decode(ids[:_read])
        self._prefix = 0  # the window decoded on each call starts here
        self._read = 0  # the tokens before it are in _kept
        self._context = ""  # decode(ids[_prefix:_read])
        self._exact = True

    @property
    def num_kept_chars(self) -> int:
        """Characters at the start of the text that no later token can change (for a tokenizer
        whose text grows at its end; 0 once it turned out not to)."""
        return len(self._kept) if self._exact else 0

    def text(self, ids: Sequence[int]) -> str:
        """``decode(ids)``, where ``ids`` extends the ids of the previous call."""
        n = len(ids)
        if not self._exact or n < self._read:  # not a growing list: decode it all
            self._exact = False
            return self._decode(ids)
        if n == self._read:
            return self._kept
        window = self._decode(ids[self._prefix :])
        if not window.startswith(self._context):
            self._exact = False
            return self._decode(ids)
        tail = window[len(self._context) :]
        if not tail.endswith(_PARTIAL):
            self._kept += tail
            self._prefix, self._read = self._read, n
            self._context = self._decode(ids[self._prefix : n])
        return self._kept + tail if tail.endswith(_PARTIAL) else self._kept
