"""Proxying to OpenAI-compatible servers (vLLM, SGLang, llama.cpp) with the same balancing,
affinity, retries and stream rewriting as splitfire's own workers."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from json.decoder import scanstring
from typing import Any

import aiohttp

from router.chunks import Chunk, WorkerError

_CONTENT = re.compile(rb'"(?:content|text)":"((?:[^"\\]|\\.)*)"')


def _batch_text(lines: bytes) -> str | None:
    """The text of a whole read's worth of plain content-delta events in one regex pass and one
    string decode (the common case while streaming); None when any event needs a closer look."""
    if b'"finish_reason":"' in lines or b'"usage":{' in lines or b"[DONE]" in lines:
        return None
    parts = _CONTENT.findall(lines)
    if len(parts) != lines.count(b"data:"):
        return None
    return json.loads(b'"' + b"".join(parts) + b'"')


def _fast_text(payload: bytes) -> str | None:
    """The text of a plain content-delta event without parsing the whole JSON object (the common
    case, ~7 us saved per token); None when the event carries anything else worth reading."""
    if b'"finish_reason":null' not in payload or b'"usage":{' in payload:
        return None
    for key in (b'"content":"', b'"text":"'):
        i = payload.find(key)
        if i != -1:
            s = payload.decode()
            j = s.find(key.decode())
            return scanstring(s, j + len(key))[0]
    return None


def _merge_event(c: Chunk, obj: dict[str, Any]) -> None:
    for ch in obj.get("choices") or []:
        c.text += (ch.get("delta") or {}).get("content") or ch.get("text") or ""
        c.finish_reason = ch.get("finish_reason") or c.finish_reason
    usage = obj.get("usage")
    if usage:
        c.prompt_tokens = usage.get("prompt_tokens", 0)
        c.completion_tokens = usage.get("completion_tokens", 0)
        c.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class OpenAIUpstreamClient:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=30, enable_cleanup_closed=True)
            self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(self, base_url: str, kind: str, body: dict[str, Any], max_tokens: int) -> AsyncIterator[Chunk]:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        body = {**body, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens}
        body.pop("max_completion_tokens", None)
        try:
            async with self.session().post(base_url.rstrip("/") + path, json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:500]
                    raise WorkerError(f"upstream {base_url} answered {resp.status}: {text}",
                                      retryable=resp.status >= 500 or resp.status == 429, status=resp.status,
                                      failed=base_url, failed_role="openai")
                # One Chunk per network read, not per SSE line: when the upstream is ahead of us,
                # its lines arrive together and leave as one write (a syscall per token was the
                # router's largest per-chunk cost).
                buf = b""
                async for data in resp.content.iter_any():
                    buf += data
                    if b"\n" not in data:
                        continue
                    lines, buf = buf.rsplit(b"\n", 1)
                    c = Chunk()
                    done = False
                    text = _batch_text(lines)
                    if text is not None:
                        if text:
                            c.text = text
                            yield c
                        continue
                    for line in lines.split(b"\n"):
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            done = True
                            break
                        text = _fast_text(payload)
                        if text is not None:
                            c.text += text
                        else:
                            _merge_event(c, json.loads(payload))
                    if c.text or c.finish_reason or c.prompt_tokens or c.completion_tokens:
                        yield c
                    if done:
                        # Read to the end of the body so the keep-alive connection goes back to
                        # the pool (returning early closed it: a new TCP connection per request).
                        await resp.content.read()
                        return
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
            raise WorkerError(f"upstream {base_url}: {type(e).__name__}: {e}", retryable=True, status=502,
                              failed=base_url, failed_role="openai") from e

    async def health(self, base_url: str, timeout_s: float) -> bool:
        s = self.session()
        for path in ("/health", "/v1/models"):
            try:
                async with s.get(base_url.rstrip("/") + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    if r.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError):
                continue
        return False
