"""Incremental detokenization with stop strings.

The reference (`IncrementalDetokenizer`) produces text by decoding a short sliding window of
tokens with the tokenizer, and emits a delta only once it no longer ends in an incomplete UTF-8
sequence (U+FFFD), so a multi-byte character split across tokens is never torn. Text that could
still turn out to be the start of a stop string is held back until it is known not to be.

The fast path (`ByteDetokenizer`, for byte-level BPE tokenizers: GPT-2's scheme, used by SmolLM2,
Llama 3, Qwen, DeepSeek) looks each token's bytes up in a table made once from the vocabulary and
feeds them to an incremental UTF-8 decoder: no tokenizer call per token (the window decode was two
calls, about 14% of the engine thread's time at 64 streams). Its deltas can come a token earlier
(a complete character is not held behind an incomplete one), never later, and their concatenation
is the reference's text: `tests/test_tokenizer_and_template.py` holds the two equal.
"""

from __future__ import annotations

import codecs
from typing import Protocol

# Leading prompt tokens kept as decoding context: tokenizers that drop a word's leading
# space at the start of a decode need a token or two before it.
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def byte_pieces(self) -> list[bytes] | None: ...


def detokenizer(tokenizer: Decoder, prompt_ids: list[int], stop: list[str] | None = None) -> Detokenizer:
    """The fast path where the tokenizer has a byte table, else the reference."""
    pieces = tokenizer.byte_pieces()
    if pieces is not None:
        return ByteDetokenizer(pieces, stop)
    return IncrementalDetokenizer(tokenizer, prompt_ids, stop)


class Detokenizer:
    """Stop strings and emission over the text a subclass decodes (`_decode_new`)."""

    def __init__(self, stop: list[str] | None):
        self.text = ""  # everything decoded so far (up to a stop string, exclusive)
        self.emitted = 0  # chars of `text` already handed out
        self.stop = stop or []
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.hit: str | None = None  # the stop string that ended the text, once one has

    def _append(self, token_id: int) -> None:
        raise NotImplementedError

    def _decode_new(self, final: bool = False) -> str:
        raise NotImplementedError

    def _pending(self) -> bool:
        """Tokens not yet turned into text (an incomplete character)."""
        raise NotImplementedError

    def _add_text(self, new: str) -> bool:
        """Append decoded text; True (and `text` cut before it) when a stop string appears."""
        start = max(0, len(self.text) - self.max_stop + 1)
        self.text += new
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                at, self.hit = min(hits, key=lambda h: h[0])
                self.text = self.text[:at]
                return True
        return False

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a generated token. Returns (text safe to emit now, whether a stop string was hit)."""
        self._append(token_id)
        new = self._decode_new()
        if not new:
            return "", False
        if self._add_text(new):
            return self._emit(0), True
        if not self.stop:
            return self._emit(0), False
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
        if self._pending():
            self._add_text(self._decode_new(final=True))
        return self._emit(0)


class IncrementalDetokenizer(Detokenizer):
    """The reference: the tokenizer decodes a sliding window of tokens."""

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stop: list[str] | None = None):
        super().__init__(stop)
        self.tokenizer = tokenizer
        self.tokens = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _append(self, token_id: int) -> None:
        self.tokens.append(token_id)

    def _pending(self) -> bool:
        return self.read_offset < len(self.tokens)

    def _decode_new(self, final: bool = False) -> str:
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""


class ByteDetokenizer(Detokenizer):
    """The fast path: each token's bytes from a table, through an incremental UTF-8 decoder."""

    def __init__(self, pieces: list[bytes], stop: list[str] | None = None):
        super().__init__(stop)
        self.pieces = pieces
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.new = b""

    def _append(self, token_id: int) -> None:
        self.new = self.pieces[token_id] if 0 <= token_id < len(self.pieces) else b""

    def push(self, token_id: int) -> tuple[str, bool]:
        """`Detokenizer.push` (the reference; a test holds them equal) in one call for the common case
        of no stop strings, where every decoded character is emitted at once."""
        if self.stop:
            return super().push(token_id)
        new = self.utf8.decode(self.pieces[token_id] if 0 <= token_id < len(self.pieces) else b"")
        if new:
            self.text += new
            self.emitted = len(self.text)
        return new, False

    def _pending(self) -> bool:
        return bool(self.utf8.getstate()[0])

    def _decode_new(self, final: bool = False) -> str:
        new, self.new = self.new, b""
        return self.utf8.decode(new, final)
