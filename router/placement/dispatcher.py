"""The request path: pick, send, retry, stream.

`place` picks a route (session pin, else the policy); an `Attempt` carries the route's load
and index bookkeeping; the backend streams; `Retry` decides what a failure becomes; `Progress`
tracks what the client has, so a stream cut off mid-way resumes on another endpoint.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from common.block_hash import block_hashes, cache_scope
from common.tokenizer import Tokenizer
from common.tracing import Tracing
from common.tracing import end as end_span
from router.api.chunks import Chunk, WorkerError
from router.api.errors import APIError, unavailable
from router.api.protocol import GenRequest
from router.backends.backend import Backends, Route, TokenRelay
from router.core.affinity import SessionAffinity
from router.core.config import RouterConfig
from router.core.endpoints import Endpoint, EndpointRegistry
from router.core.metrics import RouterMetrics
from router.core.prefix_index import PrefixLookup
from router.placement.attempt import Attempt
from router.placement.balancer import Placement, Policy, token_cost
from router.placement.resume import Progress
from router.placement.retry import Retry, counts_against_endpoint

log = logging.getLogger("splitfire.router")
# a chosen endpoint's attributes on the attempt's span, per role: address, load, expected cached blocks, cost
_ROLE_ATTRIBUTES = {role: (f"splitfire.{role}", f"splitfire.{role}.load_tokens",
                           f"splitfire.{role}.expected_cached_blocks", f"splitfire.{role}.cost")
                    for role in ("decode", "prefill")}


def index_scope(req: GenRequest) -> str:
    """The prefix index's scope of a request: the workers' own (tenant, adapter), so the hashes are the
    ones their KV events carry (router/kv_events.py). With several models, each endpoint serves one
    model, so its map never mixes them; only the fleet-wide estimate of the shared store could."""
    return cache_scope(req.tenant, req.adapter)


class TokenWriter(Protocol):
    """Where the direct relay sends a stream's plain tokens (router/direct_relay.py's `DirectStream`)."""

    def ready(self) -> bool:
        """Whether it can take tokens now (the response head is out, the client keeps up)."""
        ...

    def tokens(self, text: str, token_ids: Sequence[int]) -> None:
        """Count and write them as the stream's reader would have."""
        ...


class Dispatcher:
    def __init__(self, cfg: RouterConfig, registry: EndpointRegistry, policy: Policy, affinity: SessionAffinity,
                 index: PrefixLookup, backends: Backends | None, metrics: RouterMetrics, tokenizer: Tokenizer | None,
                 tracing: Tracing | None = None):
        self.cfg = cfg
        self.registry = registry
        self.policy = policy
        self.affinity = affinity
        self.index = index
        self.backends = backends
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.tracing = tracing  # spans of placement and of each attempt, under the request's (req.span)
        self.pool_tokenizers: dict[str, Tokenizer | None] = {}  # a router serving several models: each one's

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
        decodes = self.registry.healthy("decode", exclude) + self.registry.healthy("colocated", exclude)
        prefills = self.registry.healthy("prefill", exclude)
        if req.pool:  # a router serving several models: that model's workers
            decodes = [e for e in decodes if e.serves(req.pool)]
            prefills = [e for e in prefills if e.serves(req.pool)]
            if not decodes:
                raise unavailable(f"no healthy worker serves model '{req.model}' now; retry shortly")
            # Workers with the model loaded first: another would load it (and may evict one) before the
            # first token.
            decodes = [e for e in decodes if e.holds(req.pool)] or decodes
        if req.adapter:  # a LoRA adapter: the workers that have it resident
            decodes = [e for e in decodes if req.adapter in e.adapters]
            prefills = [e for e in prefills if req.adapter in e.adapters]
            if not decodes:
                raise unavailable(f"no healthy worker holds adapter '{req.adapter}' now; retry shortly")
        if not decodes:  # upstreams that list their models serve only those
            decodes = [e for e in self.registry.healthy("openai", exclude) if not e.models or req.model in e.models]
            prefills = []
        if not decodes:
            raise unavailable("no healthy workers to serve this request; retry shortly")
        n, bs = len(req.prompt_token_ids), self.registry.block_size
        max_blocks = (n - 1) // bs

        def cached(ep: Endpoint) -> int:
            if req.pool and ep.hosted and req.pool != ep.served_model:
                return 0  # (a worker hosting several models publishes its first model's blocks only)
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

    # -- the request ------------------------------------------------------------------

    async def run(self, req: GenRequest, direct: TokenWriter | None = None) -> AsyncGenerator[Chunk, None]:
        """Yields the request's chunks; the last carries finish_reason and usage for the whole request.
        `direct`: a backend that can (the multiplexed worker stream) hands the plain tokens of the stream to
        it as they arrive, with this request's bookkeeping done as `_relay` does it; those are not yielded."""
        hashes = (block_hashes(index_scope(req), req.prompt_token_ids, self.registry.block_size)
                  if self.cfg.prefix_aware and self.tokenizer is not None else [])
        progress, retry = Progress(), Retry(self.cfg, self.metrics, req.id)
        while True:
            attempt = await self._attempt(req, hashes, progress, retry)
            try:
                async for c in self._relay(req, attempt, progress, direct):
                    yield c
                break
            except WorkerError as e:
                if progress.finish is not None:  # everything arrived; only the stream's end went wrong
                    log.warning("event=error_after_finish rid=%s error=%r", req.id, str(e))
                    break
                self._blame(attempt, e)
                attempt.close()
                if attempt.span is not None:
                    self._end_attempt_span(attempt, progress, str(e), e.status)
                await retry.after(e, attempt.backend.token_level, progress,
                                  self.pool_tokenizers.get(req.pool, self.tokenizer))
            finally:
                attempt.close()  # also when the client disconnects mid-stream (GeneratorExit/CancelledError)
                if attempt.span is not None:
                    self._end_attempt_span(attempt, progress)
        yield self._final(req, attempt, progress, hashes)

    async def _attempt(self, req: GenRequest, hashes: list[bytes], progress: Progress, retry: Retry) -> Attempt:
        traced = req.span is not None and self.tracing is not None
        t0 = time.perf_counter() if traced else 0.0
        try:
            route = await self.place(req, hashes, retry.exclude)
        except APIError as e:
            if traced:  # (the request's span ends with the error; it says what placement saw)
                req.span.set_attributes(self._placement_attributes(req, None, hashes, t0, retry))
            raise retry.nowhere_left(e) from e
        assert self.backends is not None
        req.served_by = route.pin()
        attempt = Attempt(retry.attempts, route, self.backends.of(route.decode), self.registry, self.index, hashes,
                          len(req.prompt_token_ids), len(progress.generated),
                          req.sampling.max_tokens - len(progress.generated))
        if traced:
            attrs = self._placement_attributes(req, route, hashes, t0, retry)
            if progress.generated:
                attrs["splitfire.resumed_tokens"] = len(progress.generated)
            attempt.span = self.tracing.span("router.attempt", req.span, "client", attrs)  # type: ignore[union-attr]
            req.traceparent = self.tracing.traceparent(attempt.span)  # type: ignore[union-attr]
        return attempt

    # -- traces (common/tracing.py; only with req.span set) ------------------------------

    def _placement_attributes(self, req: GenRequest, route: Route | None, hashes: list[bytes], t0: float,
                              retry: Retry) -> dict[str, Any]:
        """What placement chose and why, for the attempt's span (or the request's, when nothing was left): per
        chosen endpoint its load, the prompt blocks it is expected to hold and the policy's cost
        (`balancer.token_cost`: load + uncached prompt tokens); the endpoints excluded after failures; the
        time placement took. (Attributes, not a span of its own: one span fewer per request. Defaults are left
        out: no `splitfire.attempt` and `splitfire.excluded` on a first attempt, no `splitfire.prefill` when the
        decode worker prefills; the policy is the router's resource attribute `splitfire.router.policy`.)"""
        n, bs = len(req.prompt_token_ids), self.registry.block_size
        attrs: dict[str, Any] = {"splitfire.placement_ms": round((time.perf_counter() - t0) * 1e3, 3)}
        if retry.attempts:  # (failures before this one: 1 on the first retry)
            attrs["splitfire.attempt"] = retry.attempts
        if retry.exclude:
            attrs["splitfire.excluded"] = sorted(retry.exclude)
        for role, ep in (("decode", route.decode if route else None), ("prefill", route.prefill if route else None)):
            if ep is None:
                continue
            cached = self.index.cached_tokens(ep.address, hashes, (n - 1) // bs, bs) if hashes else 0
            names = _ROLE_ATTRIBUTES[role]
            attrs[names[0]] = ep.address
            attrs[names[1]] = ep.load()
            attrs[names[2]] = cached // bs
            attrs[names[3]] = token_cost(ep, Placement(n, _fixed(cached)))
        return attrs

    def _end_attempt_span(self, attempt: Attempt, progress: Progress, error: str | None = None,
                          status: int | None = None) -> None:
        end_span(attempt.span, error=error, generated_tokens=len(progress.generated),
                 prefill_mode=attempt.prefill_mode or None, status=status,
                 result="failed" if error else ("finished" if progress.finish else "abandoned"))
        attempt.span = None

    async def _relay(self, req: GenRequest, attempt: Attempt, progress: Progress,
                     direct: TokenWriter | None = None) -> AsyncIterator[Chunk]:
        """One attempt's stream to the client; the chunk that brings the finish is held back (it
        leaves as the final chunk, with the whole request's usage)."""
        relay = direct_relay(attempt, progress, direct) if direct is not None else None
        stream = attempt.backend.generate(attempt.route, req, progress.generated, attempt.max_tokens,
                                          attempt.number, self.cfg.request_timeout_s, relay)
        async for c in stream:
            if c.prefill_mode:
                attempt.on_prefill_mode(c.prefill_mode)
            if c.has_output:
                attempt.on_output(len(c.token_ids) or 1)
            progress.take(c)
            if progress.held.has_output:
                yield progress.held  # more output after a finish (usage in its own event): send it on
                progress.held = Chunk()
            if c.finish_reason:
                progress.finish, c.finish_reason, progress.held = c.finish_reason, None, c
            elif c.has_output:
                yield c

    def _blame(self, attempt: Attempt, e: WorkerError) -> None:
        if not counts_against_endpoint(e):
            return
        route = attempt.route
        ep = (self.registry.get(e.failed_role or route.decode.role, e.failed) if e.failed else None) or route.decode
        attempt.blame(ep, str(e))

    def _final(self, req: GenRequest, attempt: Attempt, progress: Progress, hashes: list[bytes]) -> Chunk:
        prompt, last = req.prompt_token_ids, progress.held
        if attempt.backend.token_level:  # the router counted the tokens itself
            if hashes and progress.generated:  # the output is the next turn's prompt prefix
                self.index.insert(attempt.route.decode.address,
                                  block_hashes(index_scope(req), prompt + progress.generated,
                                               self.registry.block_size))
            last.prompt_tokens, last.completion_tokens = len(prompt), len(progress.generated)
        else:
            last.prompt_tokens, last.completion_tokens = progress.usage[0] or len(prompt), progress.usage[1]
        last.finish_reason = progress.finish or "stop"
        last.cached_tokens = progress.usage[2]
        return last


def _fixed(tokens: int) -> Callable[[Endpoint], int]:
    return lambda _ep: tokens


def direct_relay(attempt: Attempt, progress: Progress, writer: TokenWriter) -> TokenRelay:
    """`_relay`'s work for a chunk of plain tokens (no finish, logprobs or prefill mode), done where the
    backend receives them, then the tokens to `writer`: the fast path beside `_relay`, which stays the
    reference (tests/test_direct_relay.py holds the two to the same stream). It declines — and the
    tokens go through `_relay` — whenever `_relay` would do more than that: after a finish, while a
    failover's replayed text is being skipped, or when the writer cannot take them now."""

    def relay(text: str, token_ids: Sequence[int]) -> bool:
        if (progress.finish is not None or progress.skip_chars or progress.skip_tokens or progress.held.has_output
                or not writer.ready()):
            return False
        if text or token_ids:  # (Chunk.has_output)
            attempt.on_output(len(token_ids) or 1)
            progress.generated += token_ids
            progress.sent_text += text
            writer.tokens(text, token_ids)
        return True

    return relay


class Latency:
    """TTFT and inter-token latency of one choice as the client sees them, observed where the
    chunks are written (a generator layer of its own cost a frame switch per chunk)."""

    __slots__ = ("last", "metrics", "t0")

    def __init__(self, metrics: RouterMetrics, t0: float):
        self.metrics = metrics
        self.t0 = t0
        self.last: float | None = None

    def observe(self, c: Chunk) -> None:
        self.tokens(c.text, len(c.token_ids))

    def tokens(self, text: str, n_tokens: int) -> None:
        if not (text or n_tokens):
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.t0)
        else:
            n = max(n_tokens, 1)
            self.metrics.itl.observe((now - self.last) / n, n)
        self.last = now
