"""What the client has received so far, and where a replacement endpoint picks up.

Failures before the first token are simply retried. A decode worker that dies after tokens
were streamed is replaced mid-stream: the prompt plus the tokens generated so far go to another
worker, which continues the same client stream (with greedy or seeded sampling the client sees
exactly the text of an uninterrupted run).
"""

from __future__ import annotations

from common.tokenizer import Tokenizer
from router.api.chunks import Chunk


class Progress:
    def __init__(self) -> None:
        self.generated: list[int] = []
        self.sent_text = ""
        self.sent_other = False  # an upstream sent tool-call / reasoning deltas (no text to resume after)
        self.skip_chars = 0  # already delivered, being regenerated after a failover
        self.skip_tokens = 0
        self.usage = (0, 0, 0)  # (prompt, completion, cached) as the endpoint reported them
        self.finish: str | None = None
        self.held = Chunk()  # output that came with the finish: it leaves with the final chunk

    @property
    def delivered(self) -> bool:
        return bool(self.generated or self.sent_text or self.sent_other)

    def take(self, c: Chunk) -> None:
        """Account for one chunk from the endpoint, trimming what the client already has."""
        if c.extra or c.raw_logprobs:
            self.sent_other = True
        self.generated += c.token_ids
        if self.skip_chars or self.skip_tokens:
            c.text, self.skip_chars = c.text[self.skip_chars:], max(0, self.skip_chars - len(c.text))
            dropped = min(self.skip_tokens, len(c.logprobs))
            c.logprobs, self.skip_tokens = c.logprobs[dropped:], self.skip_tokens - dropped
        self.sent_text += c.text
        if c.prompt_tokens or c.completion_tokens:
            self.usage = (c.prompt_tokens, c.completion_tokens, c.cached_tokens)

    def rewind(self, tokenizer: Tokenizer) -> None:
        """Before a failover: keep the tokens whose text the client has in full."""
        keep, self.skip_chars = resume_point(tokenizer, self.generated, self.sent_text)
        self.skip_tokens = len(self.generated) - keep
        self.generated = self.generated[:keep]


def resume_point(tokenizer: Tokenizer, generated: list[int], sent_text: str) -> tuple[int, int]:
    """Where a replacement worker should pick up: (tokens to keep, characters of its output to skip).

    The client has `sent_text`; the dead worker may have generated tokens whose text it still held
    back (an unfinished UTF-8 character, a possible stop string). Resume after the longest run of
    tokens whose text the client already has in full, let the new worker regenerate the rest (for
    greedy sampling, the same tokens), and drop the part of its text the client has already seen.
    """
    for keep in range(len(generated), -1, -1):
        text = tokenizer.decode(generated[:keep])
        if sent_text.startswith(text) and not text.endswith("\ufffd"):
            return keep, len(sent_text) - len(text)
    return 0, len(sent_text)
