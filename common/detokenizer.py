"""Incremental detokenization with stop strings.

Text is produced by decoding a short sliding window of tokens, and a delta is only
emitted once it no longer ends in an incomplete UTF-8 sequence (U+FFFD), so a
multi-byte character split across tokens is never torn. Text that could still turn
out to be the start of a stop string is held back until it is known not to be.
"""

from __future__ import annotations

from typing import Protocol

# Leading prompt tokens kept as decoding context: tokenizers that drop a word's leading
# space at the start of a decode need a token or two before it.
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # everything decoded so far (up to a stop string, exclusive)
        self.emitted = 0  # chars of `text` already handed out
        self.stop = stop or []
        self.max_stop = max((len(s) for s in self.stop), default=0)

    def _decode_new(self, final: bool = False) -> str:
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""

    def _add_text(self, new: str) -> bool:
        """Append decoded text; True (and `text` cut before it) when a stop string appears."""
        start = max(0, len(self.text) - self.max_stop + 1)
        self.text += new
        if self.stop:
            hits = [i for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                self.text = self.text[: min(hits)]
                return True
        return False

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a generated token. Returns (text safe to emit now, whether a stop string was hit)."""
        self.tokens.append(token_id)
        new = self._decode_new()
        if not new:
            return "", False
        if self._add_text(new):
            return self.flush(), True
        return self._emit(self._holdback()), False

    def _holdback(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for n in range(min(self.max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _emit(self, holdback: int) -> str:
        end = len(self.text) - holdback
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def flush(self) -> str:
        """Everything not yet emitted: the request is over, so held-back text and a trailing
        incomplete character (decoded as U+FFFD, as every detokenizer must) are final."""
        if self.read_offset < len(self.tokens):
            self._add_text(self._decode_new(final=True))
        return self._emit(0)
