"""The request path: pick, send, retry, stream.

Failures before the first token are retried elsewhere with backoff. A decode worker
that dies after tokens were streamed is replaced mid-stream: the prompt plus the tokens
generated so far go to another worker, which continues the same client stream (with
greedy sampling the client sees exactly the text of an uninterrupted run).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.block_hash import block_hashes
from engine.tokenizer import Tokenizer
from router.affinity import Pin, SessionAffinity
from router.balancer import Placement, Policy
from router.chunks import Chunk, WorkerError
from router.config import RouterConfig
from router.endpoints import Endpoint, EndpointRegistry
from router.errors import APIError, unavailable
from router.metrics import RouterMetrics
from router.openai_upstream import OpenAIUpstreamClient
from router.prefix_index import PrefixIndex
from router.protocol import GenRequest
from router.worker_client import WorkerClient

log = logging.getLogger("splitfire.router")


@dataclass
class Route:
    decode: Endpoint  # decode, colocated or OpenAI upstream: where the stream comes from
    prefill: Endpoint | None  # None: the decode endpoint prefills itself

    def pin(self) -> Pin:
        return Pin(self.prefill.address if self.prefill else "", self.decode.address)


class Ticket:
    """One attempt's contribution to the endpoints' in-flight token estimates."""

    def __init__(self, route: Route, prompt_tokens: int, uncached: int, max_tokens: int):
        self.route = route
        self.prefiller = route.prefill or route.decode
        self.uncached = uncached
        self.held = prompt_tokens
        self.remaining = max_tokens
        self.prefilling = True
        self.closed = False
        self.prefiller.prefill_tokens += uncached
        d = route.decode
        d.held_tokens += prompt_tokens
        d.remaining_tokens += max_tokens
        d.active += 1
        if route.prefill is not None:
            route.prefill.active += 1
        for ep in (route.decode, route.prefill):
            if ep is not None:
                ep.note_peak()

    def on_tokens(self, n: int) -> None:
        if self.prefilling:
            self.prefilling = False
            self.prefiller.prefill_tokens -= self.uncached
            if self.route.prefill is not None:
                self.route.prefill.active -= 1
        n = min(n, self.remaining)
        d = self.route.decode
        d.held_tokens += n
        d.remaining_tokens -= n
        self.held += n
        self.remaining -= n

    def close(self) -> None:
        """Idempotent: runs on completion, on failure and when the client goes away."""
        if self.closed:
            return
        self.closed = True
        if self.prefilling:
            self.on_tokens(0)
        d = self.route.decode
        d.held_tokens -= self.held
        d.remaining_tokens -= self.remaining
        d.active -= 1
        self.held = self.remaining = 0


class Dispatcher:
    def __init__(self, cfg: RouterConfig, registry: EndpointRegistry, policy: Policy, affinity: SessionAffinity,
                 index: PrefixIndex, workers: WorkerClient, upstreams: OpenAIUpstreamClient, metrics: RouterMetrics,
                 tokenizer: Tokenizer | None):
        self.cfg = cfg
        self.registry = registry
        self.policy = policy
        self.affinity = affinity
        self.index = index
        self.workers = workers
        self.upstreams = upstreams
        self.metrics = metrics
        self.tokenizer = tokenizer

    # -- placement --------------------------------------------------------------------

    def _overloaded(self, ep: Endpoint, peers: list[Endpoint]) -> bool:
        load = ep.load()
        if load <= self.cfg.affinity_overload_min_tokens:
            return False
        mean = statistics.fmean(p.load() for p in peers) if peers else 0.0
        return load > self.cfg.affinity_overload_factor * max(mean, 1.0)

    async def _pinned(self, req: GenRequest, decodes: list[Endpoint], prefills: list[Endpoint]) -> Route | None:
        pin = await self.affinity.lookup(req.tenant, req.session)  # type: ignore[arg-type]
        if pin is None:
            self.metrics.affinity.labels(result="miss").inc()
            return None
        d = next((e for e in decodes if e.address == pin.decode), None)
        p = next((e for e in prefills if e.address == pin.prefill), None) if pin.prefill else None
        ok = d is not None and not self._overloaded(d, decodes)
        if ok and pin.prefill:
            ok = p is not None and not self._overloaded(p, prefills)
        if ok and not pin.prefill and d is not None and d.role == "decode" and prefills:
            ok = False  # pinned without a prefill worker, and one is available now
        if not ok:
            self.metrics.affinity.labels(result="break").inc()
            log.info("event=affinity_break rid=%s session=%s pin=%s", req.id, req.session, pin.encode())
            return None
        self.metrics.affinity.labels(result="hit").inc()
        assert d is not None
        return Route(d, p)

    async def place(self, req: GenRequest, hashes: list[bytes], exclude: set[str]) -> Route:
        decodes = [e for e in self.registry.healthy("decode") + self.registry.healthy("colocated")
                   if e.address not in exclude]
        prefills = [e for e in self.registry.healthy("prefill") if e.address not in exclude]
        if not decodes:
            decodes = [e for e in self.registry.healthy("openai") if e.address not in exclude]
            prefills = []
        if not decodes:
            raise unavailable("no healthy workers to serve this request; retry shortly")
        n, bs = len(req.prompt_token_ids), self.registry.block_size
        max_blocks = (n - 1) // bs

        def cached(ep: Endpoint) -> int:
            return self.index.cached_tokens(ep.address, hashes, max_blocks, bs)

        route = await self._pinned(req, decodes, prefills) if req.session else None
        if route is None:
            placement = Placement(n, cached)
            d, p = self.policy.pick_route(decodes, prefills, placement)
            route = Route(d, p)
            if req.session:
                await self.affinity.pin(req.tenant, req.session, route.pin())
        for ep in (route.decode, route.prefill):
            if ep is not None:
                self.metrics.child(self.metrics.decisions, self.policy.name, ep.role, ep.address).inc()
        return route

    # -- sending ----------------------------------------------------------------------

    def _send(self, route: Route, req: GenRequest, generated: list[int], max_tokens: int, attempt: int
              ) -> AsyncIterator[Chunk]:
        d = route.decode
        if d.role == "openai":
            return self.upstreams.generate(d.address, req.kind, req.body, max_tokens, self.cfg.request_timeout_s)
        return self.workers.generate(d.address, route.prefill.address if route.prefill else "",
                                     f"{req.id}-{req.prompt_index}-{attempt}", req.prompt_token_ids + generated,
                                     req.sampling, max_tokens, req.tenant, self.cfg.request_timeout_s,
                                     resumed_tokens=len(generated))

    async def run(self, req: GenRequest) -> AsyncIterator[Chunk]:
        """Yields the request's chunks; the last carries finish_reason and usage for the whole request."""
        prompt = req.prompt_token_ids
        bs = self.registry.block_size
        hashes = (block_hashes(req.tenant, prompt, bs)
                  if self.cfg.prefix_aware and self.tokenizer is not None else [])
        generated: list[int] = []
        sent_text = ""
        sent_other = False  # an upstream sent tool-call / reasoning deltas (no text to resume after)
        skip_chars = skip_tokens = 0  # already delivered, being regenerated after a failover
        exclude: set[str] = set()
        attempt = 0
        cached_tokens = 0
        last_error: WorkerError | None = None
        while True:
            try:
                route = await self.place(req, hashes, exclude)
            except APIError as e:
                if last_error is None:
                    raise
                # Nothing left to retry on: the client learns what actually went wrong.
                raise APIError(last_error.status, f"request failed after {attempt} attempt(s), no other endpoint "
                               f"to try: {last_error}", type_="upstream_error", code="worker_failed") from e
            req.served_by = route.pin()
            max_tokens = req.sampling.max_tokens - len(generated)
            uncached_at = route.prefill or route.decode
            uncached = len(prompt) - self.index.cached_tokens(uncached_at.address, hashes, (len(prompt) - 1) // bs, bs)
            ticket = Ticket(route, len(prompt) + len(generated), uncached, max_tokens)
            if hashes:  # the decode side holds the prompt's blocks either way; the prefill side only
                self.index.insert(route.decode.address, hashes)  # if the decode worker sends it the prompt
            finish = None
            usage = (0, 0, 0)
            last = Chunk()  # the output that came with the finish: it leaves with the final chunk
            try:
                async for c in self._send(route, req, generated, max_tokens, attempt):
                    if c.prefill_mode == "remote" and route.prefill is not None and hashes:
                        self.index.insert(route.prefill.address, hashes)
                    if c.has_output:
                        ticket.on_tokens(len(c.token_ids) or 1)
                        sent_other = sent_other or bool(c.extra or c.raw_logprobs)
                    generated += c.token_ids
                    if skip_chars or skip_tokens:
                        c.text, skip_chars = c.text[skip_chars:], max(0, skip_chars - len(c.text))
                        dropped = min(skip_tokens, len(c.logprobs))
                        c.logprobs, skip_tokens = c.logprobs[dropped:], skip_tokens - dropped
                    sent_text += c.text
                    if c.prompt_tokens or c.completion_tokens:
                        usage = (c.prompt_tokens, c.completion_tokens, c.cached_tokens)
                        cached_tokens = c.cached_tokens
                    if last.has_output:
                        yield last  # more output after a finish (usage in its own event): send it on
                        last = Chunk()
                    if c.finish_reason:
                        finish = c.finish_reason
                        c.finish_reason = None
                        last = c
                    elif c.has_output:
                        yield c
            except WorkerError as e:
                if finish is not None:  # everything arrived; only the stream's end went wrong
                    log.warning("event=error_after_finish rid=%s error=%r", req.id, str(e))
                    break
                last_error = e
                ticket.close()
                attempt += 1
                if e.failed:
                    ep = self.registry.get(e.failed_role or route.decode.role, e.failed) or route.decode
                    self.registry.mark_failed(ep, str(e))
                    exclude.add(e.failed)
                if not e.retryable:
                    raise APIError(e.status, str(e), type_="invalid_request_error" if e.status == 400 else "upstream_error") from e
                can_failover = route.decode.role != "openai" or not (generated or sent_text or sent_other)
                if attempt > self.cfg.max_retries or not can_failover:
                    raise APIError(e.status, f"request failed after {attempt} attempt(s): {e}", type_="upstream_error",
                                   code="worker_failed") from e
                kind = "failover" if (generated or sent_text) else "retry"
                self.metrics.retries.labels(kind=kind).inc()
                log.warning("event=%s rid=%s attempt=%d failed=%s generated=%d error=%r", kind, req.id, attempt,
                            e.failed, len(generated), str(e))
                if kind == "failover" and self.tokenizer is not None:
                    keep, skip_chars = resume_point(self.tokenizer, generated, sent_text)
                    skip_tokens = len(generated) - keep
                    generated = generated[:keep]
                await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))
                continue
            finally:
                ticket.close()  # also when the client disconnects mid-stream (GeneratorExit/CancelledError)
            break
        if hashes and route.decode.role != "openai" and generated:
            self.index.insert(route.decode.address,
                              block_hashes(req.tenant, prompt + generated, bs))
        last.finish_reason = finish or "stop"
        last.prompt_tokens = len(prompt) if route.decode.role != "openai" else (usage[0] or len(prompt))
        last.completion_tokens = len(generated) if route.decode.role != "openai" else usage[1]
        last.cached_tokens = cached_tokens
        yield last


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


class Latency:
    """TTFT and inter-token latency of one choice as the client sees them, observed where the
    chunks are written (a generator layer of its own cost a frame switch per chunk)."""

    __slots__ = ("last", "metrics", "t0")

    def __init__(self, metrics: RouterMetrics, t0: float):
        self.metrics = metrics
        self.t0 = t0
        self.last: float | None = None

    def observe(self, c: Chunk) -> None:
        if not (c.text or c.token_ids):
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.t0)
        else:
            n = max(len(c.token_ids), 1)
            self.metrics.itl.observe((now - self.last) / n, n)
        self.last = now
