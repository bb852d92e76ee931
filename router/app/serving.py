"""The serving path of one generation request: the route reads and scopes the body, picks the model's
pool and parses it (`api/`), then `serve` charges the caller's quota, waits for an admission slot
(`tenancy/`), and hands each choice to the dispatcher (`placement/`), writing the reply as one JSON
body (`complete`) or an SSE stream (`stream`: the head held back for the first chunk, one write per
upstream read, a final error event instead of a hang).

    route (chat | completions | responses) -> serve -> quota -> admission -> complete | stream
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from common.tracing import Tracing, wall_ns
from common.tracing import end as end_span
from router.api import messages, responses
from router.api.chunks import merge_delta_extra, merge_logprobs
from router.api.errors import APIError, bad_request
from router.api.protocol import GenRequest
from router.api.sse import ChoiceWriter, ReplyFormat, usage_dict, with_usage
from router.app.body import read_json
from router.app.direct_relay import DirectStream
from router.core.config import RouterConfig
from router.core.metrics import RouterMetrics
from router.core.model_pools import ModelPools
from router.placement.dispatcher import Dispatcher, Latency
from router.tenancy.admission import Admission
from router.tenancy.quotas import Quotas
from router.tenancy.tenants import Caller, Tenants

log = logging.getLogger("splitfire.router")

# What a batch may run: its endpoint -> the route's kind (see `_parsed`).
BATCH_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses"}


class ServingPath:
    def __init__(self, cfg: RouterConfig, pools: ModelPools, tenants: Tenants, quotas: Quotas, admission: Admission,
                 dispatcher: Dispatcher, metrics: RouterMetrics, tracing: Tracing | None = None):
        self.cfg = cfg
        self.pools = pools
        self.tenants = tenants
        self.quotas = quotas
        self.admission = admission
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.tracing = tracing  # the request's span and its admission's (common/tracing.py)

    # -- routes -------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "completions")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API (api/responses.py): the chat path underneath, Responses shapes out."""
        return await self._route(request, "responses")

    async def _route(self, request: web.Request, kind: str) -> web.StreamResponse:
        caller = self.tenants.caller(request)
        body = self._scoped(caller, await read_json(request))
        reqs, fmt = self._parsed(kind, body, caller, request.headers.get("x-session-affinity"))
        return await self.serve(request, reqs, caller, fmt)

    def _parsed(self, kind: str, body: Any, caller: Caller, session: str | None
                ) -> tuple[list[GenRequest], ReplyFormat]:
        """A generation route's body, parsed for its model's pool: the requests (one per choice) and the reply's
        wire format."""
        if kind == "responses":
            if self.pools.default.parser.upstream_only:
                raise bad_request("this router fronts OpenAI-compatible upstreams only; send /v1/responses to them, "
                                  "or use /v1/chat/completions here")
            chat_body = responses.to_chat(body)
            pool = self.pools.pool_for(chat_body)
            req = self.pools.pooled(pool, pool.parser.chat(chat_body, caller.tenant, session))[0]
            return [req], responses.ResponsesFormat(req, body)
        pool = self.pools.pool_for(body)
        parse = pool.parser.chat if kind == "chat" else pool.parser.completions
        return self.pools.pooled(pool, parse(body, caller.tenant, session)), pool.openai_format

    async def answer(self, endpoint: str, body: dict[str, Any], key_id: str, priority: int
                     ) -> tuple[int, dict[str, Any]]:
        """One non-streaming request made on a key's behalf (a batch's line, router/batch/runner.py), at
        `priority`: (HTTP status, JSON body), errors included, as the route would have answered."""
        caller = self.tenants.by_key_id(key_id)
        if caller is None:
            return 401, APIError(401, "the batch's API key is no longer valid", type_="authentication_error",
                                 code="invalid_api_key").body()
        try:
            reqs, fmt = self._parsed(BATCH_ENDPOINTS[endpoint], self._scoped(caller, body), caller, None)
            resp = await self.serve(None, reqs, caller, fmt, priority)
        except APIError as e:
            return e.status, e.body()
        assert isinstance(resp, web.Response) and isinstance(resp.body, bytes)
        return resp.status, json.loads(resp.body)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API (api/messages.py): the chat path underneath, content blocks out."""
        caller = self.tenants.caller(request)
        body = self._scoped(caller, await read_json(request))
        if self.pools.default.parser.upstream_only:
            raise bad_request("this router fronts OpenAI-compatible upstreams only; /v1/messages needs workers")
        chat_body = messages.to_chat(body)
        pool = self.pools.pool_for(chat_body)
        session = request.headers.get("x-session-affinity")
        req = self.pools.pooled(pool, pool.parser.chat(chat_body, caller.tenant, session))[0]
        return await self.serve(request, [req], caller, messages.MessagesFormat(req, body))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """`/v1/messages/count_tokens`: the prompt the chat template makes of the request, counted."""
        caller = self.tenants.caller(request)
        body = self._scoped(caller, await read_json(request))
        chat_body = messages.count_tokens_chat(body)
        pool = self.pools.pool_for(chat_body)
        if pool.parser.upstream_only:
            raise bad_request("this router fronts OpenAI-compatible upstreams only; it has no tokenizer to count with")
        req = pool.parser.chat(chat_body, caller.tenant, None)[0]
        return web.json_response({"input_tokens": len(req.prompt_token_ids)})

    def _scoped(self, caller: Caller, body: Any) -> Any:
        """A key limited to some models asking for another gets the 404 of a model that does not exist."""
        if caller.policy.models is not None and isinstance(body, dict) and isinstance(body.get("model"), str):
            self.pools.check_visible(body["model"], caller.policy.may_use)
        return body

    async def serve(self, request: web.Request | None, reqs: list[GenRequest], caller: Caller,
                    fmt: ReplyFormat, priority: int | None = None) -> web.StreamResponse:
        """`request` None: a request made inside the router (a batch line: never streamed, never traced);
        `priority`: its priority, instead of the body's or the key's."""
        # What the request will use, as far as it is known: the prompt now, the completion at the end
        # (a request that fails part-way is charged its prompt).
        used = {"prompt": sum(len(r.prompt_token_ids) for r in reqs if r.sample_index == 0), "completion": 0}
        tr = self.tracing
        if tr is None or request is None:
            return await self._serve(request, reqs, caller, fmt, used, priority=priority)
        span = tr.span(f"{request.method} {request.path}",
                       tr.extract(request.headers.get("traceparent"), request.headers.get("tracestate")), "server",
                       {"http.request.method": request.method, "http.route": request.path,
                        "splitfire.request_id": reqs[0].id, "splitfire.model": reqs[0].model,
                        "splitfire.tenant": caller.tenant, "splitfire.stream": reqs[0].stream})
        if len(reqs) > 1:  # (defaults are left out: each attribute is encoded on every request)
            span.attributes["splitfire.choices"] = len(reqs)
        for r in reqs:
            r.span = span
        try:
            resp = await self._serve(request, reqs, caller, fmt, used, span, priority=priority)
        except APIError as e:
            span.set_attribute("http.response.status_code", e.status)
            end_span(span, error=f"{e.code or e.type}: {e.message}", prompt_tokens=used["prompt"])
            raise
        except BaseException as e:
            end_span(span, error=repr(e), prompt_tokens=used["prompt"])
            raise
        span.set_attribute("http.response.status_code", resp.status)
        end_span(span, prompt_tokens=used["prompt"], completion_tokens=used["completion"])
        return resp

    async def _serve(self, request: web.Request | None, reqs: list[GenRequest], caller: Caller, fmt: ReplyFormat,
                     used: dict[str, int], span: Any = None, priority: int | None = None) -> web.StreamResponse:
        tenant, policy = caller.tenant, caller.policy
        prompt = sum(len(r.prompt_token_ids) for r in reqs)
        self.metrics.prompt_tokens.inc(prompt)
        self.metrics.prompt_tokens_squared.inc(prompt * prompt)
        self.metrics.requests_started.inc()
        if priority is None:
            priority = policy.priority_of(reqs[0].body.get("priority"))  # (a 400 before any quota is taken)
        for r in reqs:
            r.weight, r.priority = policy.weight, priority
        reservation = None
        if policy.limited:
            body = reqs[0].body
            budget = (sum(r.sampling.max_tokens for r in reqs) if body.get("max_tokens") is not None
                      or body.get("max_completion_tokens") is not None else 0)
            try:
                reservation = await self.quotas.admit(caller, used["prompt"], budget)
            except APIError as e:
                self.metrics.tenants.throttle(tenant, e.param or "")
                log.info("event=request_throttled tenant=%s key=%s limit=%s", tenant, caller.key_id, e.param)
                raise
        try:
            queued = time.perf_counter()
            async with self.admission.slot(tenant, policy.weight, priority):
                t0 = time.perf_counter()
                self.metrics.tenants.admitted(tenant, t0 - queued)
                if span is not None:  # (the admission wait: attributes and an event of the request's span;
                    # priority 0 and weight 1 are left out)
                    span.set_attributes({"splitfire.priority": priority or None,
                                         "splitfire.weight": policy.weight if policy.weight != 1 else None,
                                         "splitfire.admission.wait_ms": round((t0 - queued) * 1e3, 3),
                                         "splitfire.admission.queued": self.admission.waiting,
                                         "splitfire.admission.running": self.admission.running})
                    span.add_event("admitted", wall_ns(t0))
                try:
                    if reqs[0].stream:
                        assert request is not None
                        return await self._stream(request, reqs, fmt, t0, used)
                    return await self._complete(reqs, fmt, t0, used)
                finally:
                    self.metrics.e2e.observe(time.perf_counter() - t0)
                    self.metrics.tenants.used(tenant, used["prompt"], used["completion"])
                    self.metrics.models.used(reqs[0].model, used["prompt"], used["completion"])
        finally:
            if reservation is not None:
                await self.quotas.release(reservation, used["prompt"] + used["completion"])

    async def _complete(self, reqs: list[GenRequest], fmt: ReplyFormat, t0: float,
                        used: dict[str, int]) -> web.Response:
        async def one(req: GenRequest) -> dict[str, Any]:
            r: dict[str, Any] = {"text": [], "logprobs": [], "finish_reason": "stop", "prompt": 0, "completion": 0,
                                 "cached": 0, "token_ids": []}
            latency = Latency(self.metrics, t0)
            async for c in self.dispatcher.run(req):
                latency.observe(c)
                used["completion"] += len(c.token_ids)  # so far (the quota's count if it ends early)
                r["text"].append(c.text)
                r["logprobs"] += c.logprobs
                if req.reply is not None:
                    r["token_ids"] += c.token_ids
                if c.extra:
                    merge_delta_extra(r.setdefault("extra", {}), c.extra)
                if c.raw_logprobs:
                    r["raw_logprobs"] = merge_logprobs(r.get("raw_logprobs"), c.raw_logprobs)
                if c.finish_reason:
                    r["finish_reason"], r["stop_reason"] = c.finish_reason, c.stop_reason
                    r["prompt"], r["completion"], r["cached"] = c.prompt_tokens, c.completion_tokens, c.cached_tokens
                    if req.sample_index:  # a prompt counts once, however many samples
                        r["prompt"] = r["cached"] = 0
            r["text"] = "".join(r["text"])
            return r

        results = await asyncio.gather(*(one(r) for r in reqs))
        self._count_usage(results, used)
        self._log_done(reqs[0], results, t0)
        if reqs[0].best_of:
            reqs, results = best_of(reqs, results)
        return web.json_response(fmt.body(reqs, results),
                                 dumps=lambda o: json.dumps(o, ensure_ascii=False),
                                 headers={"X-Request-Id": reqs[0].id, **_served_headers(reqs[0])})

    @staticmethod
    def _log_done(req: GenRequest, results: list[dict[str, Any]], t0: float, direct: DirectStream | None = None) -> None:
        pin = req.served_by
        log.info("event=request_done rid=%s kind=%s stream=%s tenant=%s end_user=%s prompt=%d completion=%d "
                 "cached=%d decode=%s prefill=%s total_ms=%.1f relayed_direct=%d relayed_reads=%d",
                 req.id, req.kind, req.stream, req.tenant, req.body.get("safety_identifier") or req.body.get("user") or "-",
                 sum(r["prompt"] for r in results), sum(r["completion"] for r in results),
                 sum(r["cached"] for r in results), pin.decode if pin else "-",
                 (pin.prefill or "-") if pin else "-", (time.perf_counter() - t0) * 1000,
                 direct.relayed if direct is not None else 0, direct.reads if direct is not None else 0)

    def _count_usage(self, results: list[dict[str, Any]], used: dict[str, int]) -> None:
        used["completion"] = completion = sum(r["completion"] for r in results)
        self.metrics.completion_tokens.inc(completion)
        self.metrics.completion_tokens_squared.inc(completion * completion)
        self.metrics.cached_tokens.inc(sum(r["cached"] for r in results))

    async def _stream(self, request: web.Request, reqs: list[GenRequest], fmt: ReplyFormat,
                      t0: float, used: dict[str, int]) -> web.StreamResponse:
        writers = fmt.writers(reqs)
        latencies = [Latency(self.metrics, t0) for _ in reqs]
        source: AsyncGenerator[Any, None]
        direct = None
        if len(reqs) == 1:
            if self.cfg.stream_relay == "direct" and reqs[0].reply is None and not _continuous_usage(reqs[0]):
                direct = DirectStream(writers[0], latencies[0], used)
            source = self.dispatcher.run(reqs[0], direct)
        else:
            source = _merge([self.dispatcher.run(r) for r in reqs])
        try:
            return await self._write_stream(request, reqs, fmt, writers, latencies, source, t0, used, direct)
        finally:
            # Release the worker call and the load estimates now, not when the GC gets to it
            # (the client may have gone away while we were writing).
            await source.aclose()

    async def _write_stream(self, request: web.Request, reqs: list[GenRequest], fmt: ReplyFormat,
                            writers: list[ChoiceWriter], latencies: list[Latency], source, t0: float,
                            used: dict[str, int], direct: DirectStream | None = None) -> web.StreamResponse:
        # By default the head waits for the first chunk, so that failures before any token (bad
        # input found by a worker, no capacity, no workers) get a proper HTTP status. With
        # --early-headers the 200 and the role chunk leave at once (clients with short header
        # timeouts survive long prefills); retries before the first token still happen, and a
        # request that fails anyway ends with an error event instead of a status.
        early = self.cfg.early_headers
        first = None if early else await anext(source, None)
        resp = _SSEResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                     "X-Request-Id": reqs[0].id, **({} if early else _served_headers(reqs[0]))})
        await resp.prepare(request)
        if direct is not None:
            direct.attach(request, resp)
        if early:  # the head leaves with the first body bytes: the role chunks, or an SSE comment
            await resp.write(fmt.opening(reqs, writers, early=True))
            if direct is not None:
                direct.armed = True
            try:
                first = await anext(source, None)
            except APIError as e:
                log.warning("event=stream_failed rid=%s status=%d error=%r", reqs[0].id, e.status, e.message)
                await resp.write_eof(fmt.error(e.message, e.type, e.code or "worker_failed") + fmt.done)
                return resp
        # One write per upstream read: the head, the role chunk and the first text leave
        # together, and so do the last text, the finish, usage and [DONE] (a syscall each was
        # most of the router's per-request cost in front of a fast upstream).
        out: list[bytes] = [] if early else [fmt.opening(reqs, writers, early=False)]
        render = _Render(reqs, writers, latencies, used)
        try:
            item = first
            while item is not None:
                if render.add(item, out):
                    break
                if out:
                    await resp.write(b"".join(out))
                    out.clear()
                    if direct is not None:  # the head and all before it are out: tokens may go direct now
                        direct.armed = True
                item = await anext(source, None)
            usage = render.usage
            if reqs[0].include_usage:
                out.append(writers[0].usage(usage_dict(usage["prompt"], usage["completion"], usage["cached"])))
            self._count_usage([usage], used)
            self._log_done(reqs[0], [usage], t0, direct)
        except APIError as e:  # failed after the stream started: a final error event, never a hang
            log.warning("event=stream_failed rid=%s status=%d error=%r", reqs[0].id, e.status, e.message)
            out.append(fmt.error(e.message, e.type, e.code or "worker_failed"))
        out.append(fmt.done)
        await resp.write_eof(b"".join(out))
        return resp


class _Render:
    """One stream's chunks into SSE bytes, choice by choice: replies with reasoning or tool calls parsed as
    they stream (one parser per choice), each choice's finish and usage (a prompt counted once, however many
    samples), continuous usage when asked."""

    def __init__(self, reqs: list[GenRequest], writers: list[ChoiceWriter], latencies: list[Latency],
                 used: dict[str, int]):
        self.reqs, self.writers, self.latencies, self.used = reqs, writers, latencies, used
        self.parsers = [r.reply.parser() if r.reply is not None else None for r in reqs]
        self.usage = {"prompt": 0, "completion": 0, "cached": 0}
        self.finished = 0
        self.tagged = len(reqs) > 1  # several prompts: items are (choice index, chunk)
        self.continuous = _continuous_usage(reqs[0])
        self.produced = [0] * len(reqs)
        self.prompt_once = sum(len(r.prompt_token_ids) for r in reqs if r.sample_index == 0)

    def add(self, item: Any, out: list[bytes]) -> bool:
        """`item`'s bytes appended to `out`; True once every choice has finished."""
        i, c = item if self.tagged else (0, item)
        self.latencies[i].observe(c)
        self.used["completion"] += len(c.token_ids)  # so far (the quota's count if it ends early)
        mark = len(out)
        if self.continuous:
            self.produced[i] = c.completion_tokens or self.produced[i] + len(c.token_ids)
        w, parser = self.writers[i], self.parsers[i]
        if c.extra is not None or c.raw_logprobs is not None:
            out.append(w.passthrough(c.text, c.extra, c.raw_logprobs))
        elif parser is not None:
            events = parser.feed(c.text, c.token_ids)
            if c.finish_reason:
                events += parser.close()
            if events or c.logprobs:
                out.append(w.events(events, c.logprobs))
        elif c.text or c.logprobs:
            out.append(w.text(c.text, c.logprobs))
        if c.finish_reason:
            reason = c.finish_reason
            if parser is not None and parser.calls and reason == "stop":
                reason = "tool_calls"
            out.append(w.finish(reason, c))
            if self.reqs[i].sample_index == 0:  # a prompt counts once, however many samples
                self.usage["prompt"] += c.prompt_tokens
                self.usage["cached"] += c.cached_tokens
            self.usage["completion"] += c.completion_tokens
            self.finished += 1
        if self.continuous and len(out) > mark:
            out[mark:] = [with_usage(b"".join(out[mark:]), usage_dict(self.prompt_once, sum(self.produced), 0))]
        return self.finished == len(self.writers)


def _continuous_usage(req: GenRequest) -> bool:
    """stream_options.continuous_usage_stats: usage so far on every chunk."""
    so = req.body.get("stream_options") or {}
    return bool(so.get("continuous_usage_stats"))


class _SSEResponse(web.StreamResponse):
    """Holds the response head back until the first body write, so both leave in one packet
    (aiohttp's own opt-in for buffered heads; plain StreamResponse sends the head at once)."""

    _send_headers_immediately = False


def _served_headers(req: GenRequest) -> dict[str, str]:
    """Where the request ran (the last attempt): for debugging and for tests."""
    pin = req.served_by
    if pin is None:
        return {}
    return {"X-Splitfire-Decode": pin.decode, "X-Splitfire-Prefill": pin.prefill or "-"}


def best_of(reqs: list[GenRequest], results: list[dict[str, Any]]) -> tuple[list[GenRequest], list[dict[str, Any]]]:
    """Completions' best_of: of each prompt's candidates, the n with the highest log probability
    per token (OpenAI's rule) become its choices. Usage counts every candidate's tokens (they were
    all generated), the prompt once."""
    by_prompt: dict[int, list[tuple[GenRequest, dict[str, Any]]]] = {}
    for req, r in zip(reqs, results, strict=True):
        by_prompt.setdefault(req.prompt_index // req.best_of, []).append((req, r))

    def per_token(c: tuple[GenRequest, dict[str, Any]]) -> float:
        lps = c[1]["logprobs"]
        return sum(lp.logprob for lp in lps) / max(len(lps), 1)

    kept_reqs, kept = [], []
    for p, cands in sorted(by_prompt.items()):
        n = cands[0][0].n
        for j, (req, r) in enumerate(sorted(cands, key=per_token, reverse=True)[:n]):
            kept_reqs.append(dataclasses.replace(req, prompt_index=p * n + j, sample_index=j))
            kept.append({**r, "completion": 0})
    kept[0]["completion"] = sum(r["completion"] for r in results)
    return kept_reqs, kept


async def _merge(iters: list) -> Any:
    """Interleave several choices' chunks into one stream (a list of prompts)."""
    queue: asyncio.Queue = asyncio.Queue()
    sentinel = object()

    async def pump(i: int, it) -> None:
        try:
            async for c in it:
                await queue.put((i, c))
        except BaseException as e:
            await queue.put(e)
        finally:
            await queue.put(sentinel)

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iters)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is sentinel:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


__all__ = ["ServingPath"]
