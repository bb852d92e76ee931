"""Reasoning models (Qwen3, DeepSeek-R1 style): the `<think>...</think>` at the start of a reply is
`reasoning_content`, not `content`, and streams as its own deltas."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(chat_template: str | None) -> bool:
    return bool(chat_template) and CLOSE in chat_template  # type: ignore[operator]


class ReasoningSplitter:
    """Feed the reply's text as it streams; get (reasoning, content) pieces back.

    `inside`: the prompt itself ended with `<think>` (the template opened the block), so the reply
    starts as reasoning. Otherwise a reply that begins with `<think>` enters it; anything else is
    content from the first character."""

    def __init__(self, inside: bool):
        self.state = "reasoning" if inside else "start"
        self._held = ""  # text that may be the start of a marker
        self._skip_space = inside  # whitespace right after `<think>` / `</think>` is layout

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self.state == "start":
                stripped = buf.lstrip()
                if not stripped:
                    self._held = buf
                    break
                if OPEN.startswith(stripped[: len(OPEN)]) and len(stripped) < len(OPEN):
                    self._held = buf
                    break
                if stripped.startswith(OPEN):
                    self.state, buf, self._skip_space = "reasoning", stripped[len(OPEN):], True
                    continue
                self.state = "content"
                continue
            if self.state == "reasoning":
                if self._skip_space:
                    buf = buf.lstrip()
                    if not buf:
                        break
                    self._skip_space = False
                i = buf.find(CLOSE)
                if i >= 0:
                    reasoning.append(buf[:i].rstrip("\n"))
                    self.state, buf, self._skip_space = "content", buf[i + len(CLOSE):], True
                    continue
                # Held back: a possible start of `</think>`, and newlines that may precede it.
                keep = next((k for k in range(min(len(CLOSE) - 1, len(buf)), 0, -1) if CLOSE.startswith(buf[-k:])), 0)
                body = buf[: len(buf) - keep]
                text = body.rstrip("\n")
                reasoning.append(text)
                self._held = body[len(text):] + buf[len(buf) - keep:]
                break
            if self._skip_space:
                buf = buf.lstrip()
                if not buf:
                    break
                self._skip_space = False
            content.append(buf)
            break
        return "".join(reasoning), "".join(content)

    def close(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held
