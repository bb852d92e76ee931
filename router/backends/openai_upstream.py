"""Proxying to OpenAI-compatible servers (vLLM, SGLang, llama.cpp) with the same balancing,
affinity, retries and stream rewriting as splitfire's own workers."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from json.decoder import scanstring  # type: ignore[attr-defined]  # (public, missing from the stubs)
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from router.api.chunks import Chunk, WorkerError, merge_delta_extra, merge_logprobs
from router.api.sse import compact_json
from router.backends.backend import Probe, TokenRelay
from router.backends.http_client import HTTPClient, HTTPClientError
from router.core.endpoints import Endpoint

if TYPE_CHECKING:
    from router.api.protocol import GenRequest
    from router.backends.backend import Route

log = logging.getLogger("splitfire.router")

_POST_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}

_CONTENT = re.compile(rb'"(?:content|text)":"((?:[^"\\]|\\.)*)"')


_ENDS = (b'"finish_reason":"', b'"usage":{', b"[DONE]")  # events that end a stream (compact JSON)
# Delta fields beyond the text that must reach the client: a read containing any of them is
# parsed in full (a few `bytes.find`s per read).
_EXTRAS = (b'"tool_calls"', b'"reasoning', b'"logprobs":{', b'"logprobs": {', b'"function_call"')


def _has_extras(data: bytes) -> bool:
    return any(m in data for m in _EXTRAS)


def _stream_end(lines: bytes) -> int:
    """Where the first event that ends the stream starts to show, -1 if none; 0 for JSON with
    spaces after colons (not what vLLM, SGLang or llama.cpp send): all of it is parsed in full.
    A few `bytes.find` calls: a regex alternation here cost 30 us per read."""
    if b'": ' in lines:
        return 0
    found = [i for m in _ENDS if (i := lines.find(m)) != -1]
    return min(found) if found else -1


def _json_string(inner: bytes) -> str:
    """The string a JSON string literal's escaped contents stand for (the C scanner directly:
    json.loads on bytes adds encoding detection and two regex matches, ~2 us per read)."""
    return scanstring(inner.decode() + '"', 0)[0]


def _batch_text(lines: bytes) -> str | None:
    """The text of a whole read's worth of plain content-delta events in one regex pass and one
    string decode (the common case while streaming); None when any event is something else.
    For lines before `_stream_end`: it does not look for a finish inside a content event."""
    if _has_extras(lines):
        return None
    parts = _CONTENT.findall(lines)
    if len(parts) != lines.count(b"data:"):
        return None
    return _json_string(b"".join(parts))


def _fast_text(payload: bytes) -> str | None:
    """The text of a plain content-delta event without parsing the whole JSON object (the common
    case, ~7 us saved per token); None when the event carries anything else worth reading."""
    if b'"finish_reason":null' not in payload or _stream_end(payload) != -1 or _has_extras(payload):
        return None
    for key in (b'"content":"', b'"text":"'):
        i = payload.find(key)
        if i != -1:
            s = payload.decode()
            j = s.find(key.decode())
            return scanstring(s, j + len(key))[0]
    return None


def parse_events(lines: bytes, batch_text: Callable[[bytes], str | None] = _batch_text) -> tuple[Chunk, bool]:
    """One network read's complete SSE lines as one Chunk, and whether `[DONE]` was among them.
    Plain content deltas before the first event that ends the stream (finish, usage, [DONE]) go
    through `batch_text`; only the events from there on are parsed one by one."""
    c = Chunk()
    end = _stream_end(lines)
    if end != -1:
        split = max(lines.rfind(b"data:", 0, end), 0)
        head, rest = lines[:split], lines[split:]
    else:
        head, rest = lines, b""
    if head:
        text = batch_text(head)
        if text is None:
            rest = lines
        else:
            c.text = text
    for line in rest.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        event = line[5:].strip()
        if event == b"[DONE]":
            return c, True
        text = _fast_text(event)
        if text is not None:
            c.text += text
        else:
            _merge_event(c, json.loads(event))
    return c, False


def _closing_quote(line: bytes, start: int) -> int:
    """Index of the quote that ends the JSON string starting at `start` (-1 if it does not end)."""
    j = line.find(b'"', start)
    while j != -1:
        k = j
        while k > start and line[k - 1] == 0x5C:  # backslash
            k -= 1
        if (j - k) % 2 == 0:
            return j
        j = line.find(b'"', j + 1)
    return -1


class EventParser:
    """One upstream stream's SSE. vLLM and SGLang send every plain delta of a stream with the same
    bytes around its text (same id, created, model, index); once one such event has been seen,
    a whole read of them is one split into events, one join back through the frame to prove they
    all fit it, and one string decode (~15 us for 64 events, against ~60 us for the regex pass).
    A read that does not fit the frame exactly is parsed by `parse_events`, which never depends
    on it."""

    def __init__(self) -> None:
        self._pre = b""  # an event's bytes up to its text's opening quote ("" until learned)
        self._post = b""  # and from its closing quote on
        self._sep = b""  # what lies between two texts in a read of framed events
        self._text_at = itemgetter(slice(0, 0))  # an event's text, by position
        self._buf = b""  # an incomplete line

    def feed(self, data: bytes) -> tuple[Chunk | None, bool]:
        """One network read: the Chunk of the complete lines so far (None when there are none),
        and whether `[DONE]` was among them."""
        self._buf += data
        if b"\n" not in data:
            return None, False
        lines, self._buf = self._buf.rsplit(b"\n", 1)
        return self.parse(lines)

    def plain_text(self, data: bytes) -> str | None:
        """The text `feed(data)` would give when `data` is a read of whole plain deltas in the learned
        frame (then `feed` would change nothing but return it); None for anything else. Changes nothing."""
        if self._buf or not self._pre or not data.endswith(b"\n"):
            return None
        return self._framed_text(data[:-1])

    def parse(self, lines: bytes) -> tuple[Chunk, bool]:
        if not self._pre:
            c, done = parse_events(lines)
        else:
            text = self._framed_text(lines)
            if text is not None:
                return Chunk(text=text), False
            # Most likely the read that ends the stream: the deltas before its end still fit.
            c, done = parse_events(lines, self._batch_text)
        if not done:
            self._learn(lines)
        return c, done

    def _batch_text(self, lines: bytes) -> str | None:
        text = self._framed_text(lines)
        return _batch_text(lines) if text is None else text

    def _framed_text(self, lines: bytes) -> str | None:
        lines = lines.strip(b"\n")
        pre, post = self._pre, self._post
        # (No look for extra fields: an event that is exactly the learned frame around its text carries
        # the fields of the plain delta the frame was learned from, and `_learn` takes none with extras.)
        if not (lines.startswith(pre) and lines.endswith(post)):
            return None
        parts = lines.split(b"\n")  # one byte: memchr speed; a longer separator scans ~3x slower
        events = parts[::2]
        if any(parts[1::2]):  # events are not separated by exactly one blank line
            return None
        texts = list(map(self._text_at, events))
        # Every event is the frame around its text exactly when they join back into the read.
        # A JSON string holds no unescaped quote, so one left over means the frame was ambiguous
        # (a text with an escaped quote): parse in full.
        if self._sep.join(texts) != lines[len(pre) : len(lines) - len(post)]:
            return None
        body = b"".join(texts)
        if b'"' in body:
            return None
        return _json_string(body)

    def _learn(self, lines: bytes) -> None:
        """Takes the frame from the read's last event if it is a plain delta."""
        line = lines[lines.rfind(b"data:") :].strip()
        if _fast_text(line[5:].strip()) is None:
            return
        for key in (b'"content":"', b'"text":"'):
            i = line.find(key)
            if i != -1:
                start = i + len(key)
                end = _closing_quote(line, start)
                if end != -1:
                    self._pre, self._post = line[:start], line[end:]
                    self._sep = self._post + b"\n\n" + self._pre
                    self._text_at = itemgetter(slice(start, end - len(line)))
                return


def _merge_event(c: Chunk, obj: dict[str, Any]) -> None:
    for ch in obj.get("choices") or []:
        delta = ch.get("delta") or {}
        c.text += delta.get("content") or ch.get("text") or ""
        if len(delta) > 1 or (delta and "content" not in delta):
            extra = c.extra if c.extra is not None else {}
            merge_delta_extra(extra, delta)
            c.extra = extra or c.extra
        if ch.get("logprobs"):
            c.raw_logprobs = merge_logprobs(c.raw_logprobs, ch["logprobs"])
        c.finish_reason = ch.get("finish_reason") or c.finish_reason
    usage = obj.get("usage")
    if usage:
        c.prompt_tokens = usage.get("prompt_tokens", 0)
        c.completion_tokens = usage.get("completion_tokens", 0)
        c.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class OpenAIUpstreamClient:
    """The backend for OpenAI-compatible servers (vLLM, SGLang, ...): text-level streams."""

    token_level = False

    def __init__(self, api_key: str = "") -> None:
        self.http = HTTPClient()
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._post_headers = {**_POST_HEADERS, **self._auth}

    async def close(self) -> None:
        await self.http.close()

    async def generate(self, route: Route, req: GenRequest, generated: list[int], max_tokens: int, attempt: int,
                       timeout_s: float, relay: TokenRelay | None = None) -> AsyncIterator[Chunk]:
        """With `relay`, a read of nothing but plain deltas in the stream's learned frame goes to it from the
        connection's read callback while this generator waits (`EventParser.plain_text`), and is not
        yielded when it takes it; everything else is read and yielded here."""
        base_url = route.decode.address
        path = "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"
        # One choice per call: the router fans n (and best_of) out itself, seed + j for the j-th.
        body = {**req.body, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens, "n": 1}
        body.pop("max_completion_tokens", None)
        body.pop("best_of", None)
        if req.sampling.seed is not None:
            body["seed"] = req.sampling.seed
        payload = compact_json(body).encode()
        resp = None
        try:
            headers = ({**self._post_headers, "traceparent": req.traceparent} if req.traceparent else
                       self._post_headers)  # (a traced request: the upstream's spans join its trace)
            resp = r = await self.http.request("POST", base_url, path, payload, headers, timeout_s)
            if r.status != 200:
                text = (await r.read_all())[:500].decode(errors="replace")
                # Refused credentials are this router's misconfiguration, not the client's: 502,
                # and another upstream may accept them.
                auth = resp.status in (401, 403)
                raise WorkerError(f"upstream {base_url} answered {r.status}: {text}"
                                  + (" (check --openai-upstream-api-key)" if auth else ""),
                                  retryable=r.status >= 500 or r.status == 429 or auth,
                                  status=502 if auth else r.status, failed=base_url, failed_role="openai")
            # One Chunk per network read, not per SSE line: when the upstream is ahead of us,
            # its lines arrive together and leave as one write (a syscall per token was the
            # router's largest per-chunk cost).
            events = EventParser()
            if relay is not None:
                r.sink = _plain_sink(events, relay)
            while data := await r.read_some():
                c, done = events.feed(data)
                if c is None:
                    continue
                if done:
                    # Everything is here; the body's last bytes may still be in flight: pool the
                    # connection when they arrive instead of waiting for them.
                    self.http.release_after_end(r)
                    resp = None
                if c.has_output or c.finish_reason or c.prompt_tokens or c.completion_tokens:
                    yield c
                if done:
                    return
        except (HTTPClientError, json.JSONDecodeError) as e:
            raise WorkerError(f"upstream {base_url}: {type(e).__name__}: {e}", retryable=True, status=502,
                              failed=base_url, failed_role="openai") from e
        finally:
            if resp is not None:
                self.http.release(resp)

    async def probe(self, ep: Endpoint, timeout_s: float) -> Probe:
        """Healthy when `/v1/models` (which also names the models served) or `/health` answers 200."""
        status, body = await self._get(ep.address, "/v1/models", timeout_s)
        if status == 200:
            return Probe(True, models=model_ids(body, ep.address))
        status, _ = await self._get(ep.address, "/health", timeout_s)
        return Probe(status == 200)

    async def reset_prefix_cache(self, ep: Endpoint, timeout_s: float) -> str:
        """vLLM's POST /reset_prefix_cache (served there in its dev mode)."""
        resp = None
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self.http.request("POST", ep.address, "/reset_prefix_cache", b"", self._auth)
                body = (await resp.read_all())[:200].decode(errors="replace")
        finally:
            if resp is not None:
                self.http.release(resp)
        if resp.status != 200:
            raise HTTPClientError(f"answered {resp.status}: {body}")
        return "reset"

    async def _get(self, base_url: str, path: str, timeout_s: float) -> tuple[int, bytes]:
        """(status, body); status 0 when the upstream did not answer in time."""
        resp = None
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self.http.request("GET", base_url, path, headers=self._auth)
                return resp.status, await resp.read_all()
        except (HTTPClientError, TimeoutError) as e:
            log.debug("event=upstream_probe_failed address=%s path=%s error=%r", base_url, path, e)
            return 0, b""
        finally:
            if resp is not None:
                self.http.release(resp)


def _plain_sink(events: EventParser, relay: TokenRelay) -> Callable[[bytes], bool]:
    """A response's sink (`Response.sink`): reads of plain deltas, their text to `relay` (no token ids:
    an upstream's stream carries text)."""

    def sink(data: bytes) -> bool:
        text = events.plain_text(data)
        return text is not None and relay(text, ())

    return sink


def model_ids(body: bytes, source: str) -> list[str]:
    """The model ids of an OpenAI `/v1/models` answer (an unreadable one names none, and says so)."""
    try:
        data = json.loads(body).get("data")
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (ValueError, AttributeError, TypeError) as e:
        log.warning("event=upstream_models_unreadable address=%s error=%r body=%r", source, e, body[:200])
        return []
