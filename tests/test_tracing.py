"""OpenTelemetry traces: one disaggregated request's spans from the router, the decode worker, the prefill
worker and the KV transfer, under the caller's `traceparent`, received by a real OTLP endpoint over gRPC
(opentelemetry-proto's TraceService) and over HTTP (its types); tracing off unless the standard OTEL_*
variables ask for it."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import grpc
import pytest
from grpc_client import greedy
from procs import address, base_url, free_port, start_router, start_worker

from common import tracing
from loadtest.otlp_sink import OTLPSink
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg

MODEL = "tiny"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
META_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(params=["http/protobuf", "grpc"])
def receiver(request):
    """A collector over each OTLP protocol (http/protobuf is the default)."""
    sink = OTLPSink(protocol=request.param).start()
    yield sink
    sink.stop()


def test_tracing_is_off_unless_the_environment_asks():
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"})
    with pytest.raises(ValueError, match="zipkin"):
        tracing.wanted({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    with pytest.raises(ValueError, match="http/json"):
        tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


async def test_one_trace_across_router_decode_prefill_and_the_kv_transfer(tiny_model_dir, tmp_path, receiver,
                                                                          monkeypatch):
    for k, v in receiver.env().items():
        monkeypatch.setenv(k, v)
    pre = start_worker("prefill", tiny_model_dir, tmp_path, wait=False)
    dec = start_worker("decode", tiny_model_dir, tmp_path, "--local-prefill-max-tokens", "0", wait=False)
    pre.wait_for("worker ready")
    dec.wait_for("worker ready")
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--prefill", address(pre),
                          "--decode", address(dec))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        headers = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}
        async with aiohttp.ClientSession() as s, s.post(base_url(router) + "/v1/chat/completions", json=body,
                                                        headers=headers) as r:
            assert r.status == 200, await r.text()
        # A gRPC client of the decode worker's own, instrumented the OpenTelemetry way: the context in the call's
        # metadata, not in the message (the decode worker passes it on to the prefill worker both ways).
        async with grpc.aio.insecure_channel(address(dec)) as ch:
            call = pbg.DecodeStub(ch).Generate(
                pb.GenerateRequest(token_ids=list(range(3, 43)), sampling=greedy(2), prefill_endpoint=address(pre)),
                metadata=(("traceparent", f"00-{META_TRACE_ID}-{CALLER_SPAN}-01"),))
            async for _ in call:
                pass
        want = {"POST /v1/chat/completions", "router.attempt",
                "decode.generate", "decode.queue", "decode.prefill", "decode.stream", "prefill.prefill",
                "prefill.queue", "prefill.compute", "kv.transfer"}
        deadline = time.monotonic() + 30
        while ({s.name for _, s in receiver.spans if s.trace_id.hex() == TRACE_ID} < want
               or sum(s.trace_id.hex() == META_TRACE_ID for _, s in receiver.spans) < 8) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        router.stop()
        pre.stop()
        dec.stop()
    assert {s.trace_id.hex() for _, s in receiver.spans} == {TRACE_ID, META_TRACE_ID}  # the callers' traces only
    by_metadata = {s.name: s for _, s in receiver.spans if s.trace_id.hex() == META_TRACE_ID}
    assert by_metadata["decode.generate"].parent_span_id.hex() == CALLER_SPAN
    assert by_metadata["prefill.prefill"].parent_span_id == by_metadata["decode.prefill"].span_id
    spans = {s.name: (service, s) for service, s in receiver.spans if s.trace_id.hex() == TRACE_ID}
    assert set(spans) >= want, sorted(spans)

    def parent(name: str) -> str:
        return spans[name][1].parent_span_id.hex()

    def sid(name: str) -> str:
        return spans[name][1].span_id.hex()

    def attrs(name: str) -> dict:
        out = {}
        for a in spans[name][1].attributes:
            v = a.value
            out[a.key] = v.string_value or v.int_value or v.double_value or v.bool_value
        return out

    root = "POST /v1/chat/completions"
    assert parent(root) == CALLER_SPAN
    assert parent("router.attempt") == sid(root)
    assert parent("decode.generate") == sid("router.attempt")
    for name in ("decode.queue", "decode.prefill", "decode.stream"):
        assert parent(name) == sid("decode.generate"), name
    assert parent("prefill.prefill") == sid("decode.prefill")
    for name in ("prefill.queue", "prefill.compute", "kv.transfer"):
        assert parent(name) == sid("prefill.prefill"), name
    assert {n: spans[n][0] for n in (root, "decode.generate", "prefill.prefill")} == {
        root: "splitfire-router", "decode.generate": "splitfire-decode", "prefill.prefill": "splitfire-prefill"}
    placement = attrs("router.attempt")  # (placement's choice and reasons ride on the attempt it made)
    assert placement["splitfire.decode"] == address(dec) and placement["splitfire.prefill"] == address(pre)
    assert "splitfire.decode.cost" in placement and "splitfire.prefill.expected_cached_blocks" in placement
    transfer = attrs("kv.transfer")
    assert transfer["splitfire.bytes"] > 0 and transfer["splitfire.layers"] == 2 and transfer["splitfire.blocks"] >= 1
    assert attrs(root)["http.response.status_code"] == 200 and attrs(root)["splitfire.completion_tokens"] == 4
    assert "splitfire.admission.wait_ms" in attrs(root) and any(e.name == "admitted" for e in spans[root][1].events)
    assert any(e.name == "first_token" for e in spans["decode.generate"][1].events)
    s = spans["decode.stream"][1]
    assert spans["decode.generate"][1].start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano


async def test_an_openai_upstream_gets_the_attempt_as_its_traceparent(tiny_model_dir, tmp_path, monkeypatch):
    """In front of vLLM or SGLang (`--openai-upstream`), a traced request's `traceparent` header names the
    router's attempt span, in the caller's trace, so the upstream's own spans join it."""
    from aiohttp import web

    seen: list[str | None] = []

    async def chat(req: web.Request) -> web.StreamResponse:
        seen.append(req.headers.get("traceparent"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
        usage = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        for e in (chunk, usage):
            await resp.write(f"data: {json.dumps(e)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", lambda _: web.json_response({"status": "ok"}))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    sink = OTLPSink().start()
    for k, v in sink.env().items():
        monkeypatch.setenv(k, v)
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--openai-upstream",
                          f"http://127.0.0.1:{port}")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as s:
            for traceparent in (f"00-{TRACE_ID}-{CALLER_SPAN}-01", None):
                headers = {"traceparent": traceparent} if traceparent else {}
                async with s.post(base_url(router) + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
        deadline = time.monotonic() + 30
        while sum(s.name == "router.attempt" for _, s in sink.spans) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        router.stop()
        sink.stop()
        await runner.cleanup()
    attempts = [s for _, s in sink.spans if s.name == "router.attempt"]
    assert len(attempts) == 2 and len(seen) == 2
    by_trace = {s.trace_id.hex(): s for s in attempts}
    ours = by_trace[TRACE_ID]
    assert seen[0] == f"00-{TRACE_ID}-{ours.span_id.hex()}-01"
    other = next(s for t, s in by_trace.items() if t != TRACE_ID)  # (no caller context: a trace of its own)
    assert seen[1] == f"00-{other.trace_id.hex()}-{other.span_id.hex()}-01"


def test_the_hand_written_otlp_encoding_is_what_opentelemetry_proto_reads(monkeypatch):
    """common/tracing.py writes OTLP protobuf by hand; opentelemetry-proto's own types parse it to the same
    spans, attributes of every type, events, status, parents and flags."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # (nothing is exported here)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=a%20b")
    t = tracing.Tracing("splitfire-test", {"splitfire.router.policy": "token", "team": "overridden"})
    try:
        caller = t.extract(f"00-{TRACE_ID}-{CALLER_SPAN}-01", "vendor=x")
        root = t.span("POST /v1/chat/completions", caller, "server", {"n": -3, "big": 2**40, "f": 0.25, "ok": True,
                                                                     "s": "é", "list": [1, "a", 2.5]})
        child = t.span("router.attempt", root, "client")
        child.add_event("first_token", timestamp=123)
        tracing.end(child, error="UNAVAILABLE: worker gone", generated_tokens=3)
        tracing.end(root)
        raw = tracing.encode_request({"service.name": t.service, "k": 7}, "splitfire", [root, child])
    finally:
        t.shutdown()
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(raw)
    rs = req.resource_spans[0]
    assert {a.key: a.value.string_value or a.value.int_value for a in rs.resource.attributes} == {
        "service.name": "splitfire-test", "k": 7}
    assert rs.scope_spans[0].scope.name == "splitfire"
    r, c = rs.scope_spans[0].spans
    assert r.trace_id.hex() == TRACE_ID and r.parent_span_id.hex() == CALLER_SPAN and r.trace_state == "vendor=x"
    assert c.trace_id == r.trace_id and c.parent_span_id == r.span_id and len(c.span_id) == 8
    assert (r.name, r.kind, c.kind) == ("POST /v1/chat/completions", 2, 3)
    assert r.start_time_unix_nano == root.start_ns and r.end_time_unix_nano == root.end_ns >= r.start_time_unix_nano
    attrs = {a.key: a.value for a in r.attributes}
    assert attrs["n"].int_value == -3 and attrs["big"].int_value == 2**40 and attrs["f"].double_value == 0.25
    assert attrs["ok"].bool_value is True and attrs["s"].string_value == "é"
    assert [v.WhichOneof("value") for v in attrs["list"].array_value.values] == ["int_value", "string_value",
                                                                                 "double_value"]
    assert r.flags == 1 and not r.HasField("status")
    assert [(e.name, e.time_unix_nano) for e in c.events] == [("first_token", 123)]
    assert c.status.code == 2 and c.status.message == "UNAVAILABLE: worker gone"
    assert {a.key: a.value.int_value for a in c.attributes} == {"splitfire.generated_tokens": 3}
    assert t.service == "splitfire-test" and t.batcher.resource["team"] == "a b"  # (the environment's wins)
    assert t.batcher.resource["splitfire.router.policy"] == "token"



def test_memoised_attributes_encode_as_the_first_time(monkeypatch):
    """Attribute fields are memoised per key (up to 64 values), and numbers written inline: a repeated value, a
    value of another type that compares equal (True and 1, 1 and 1.0), a key past its 64 values, and ints of
    one to five varint bytes, negative ints and floats all parse as what they were."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    t = tracing.Tracing("memo")
    try:
        spans = []
        for i in range(100):  # "i": 100 distinct values (past the memo); "same": one value; "x": three types
            s = t.span("r", attributes={"i": i, "same": "model-a", "x": [True, 1, 1.0][i % 3], "big": i * 10**9,
                                        "f": i / 7, "neg": -i})
            s.add_event("e")
            s.end()
            spans.append(s)
        raw = tracing.encode_request({}, "splitfire", spans)
    finally:
        t.shutdown()
    got = trace_service_pb2.ExportTraceServiceRequest.FromString(raw).resource_spans[0].scope_spans[0].spans
    for i, sp in enumerate(got):
        attrs = {a.key: a.value for a in sp.attributes}
        assert attrs["i"].int_value == i and attrs["same"].string_value == "model-a"
        assert (attrs["big"].int_value, attrs["f"].double_value, attrs["neg"].int_value) == (i * 10**9, i / 7, -i)
        assert [e.name for e in sp.events] == ["e"] and sp.flags == 1
        assert attrs["x"].WhichOneof("value") == ["bool_value", "int_value", "double_value"][i % 3]


def test_the_fast_attribute_encoding_equals_the_plain_one():
    """`encode_attributes` (per-key heads, memoised strings and bools, numbers written inline) gives the bytes of
    `_attribute` for every value: past a key's 64 memoised strings, at each varint length, past 2^63 and 2^64,
    negative, bool beside int, a key of 200 bytes, None left out."""
    values: list = [0, 1, 127, 128, 2**14, 2**35, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -1, -(2**40), 0.0,
                    -2.5, 1e300, True, False, "", "é" * 100, "x" * 300, [1, "a"], (2.5,), None]
    values += [f"value-{i}" for i in range(80)]
    for key in ("k", "splitfire.decode.load_tokens", "a" * 200):
        for v in values:
            for _ in range(2):  # (the second time from the memo)
                out: list[bytes] = []
                tracing.encode_attributes({key: v}, out)
                assert b"".join(out) == (b"" if v is None else tracing._attribute(key, v)), (key, v)


def test_spans_leave_over_otlp_http_with_headers_and_gzip_and_a_refusal_is_counted(monkeypatch):
    """OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf: batches POSTed to <endpoint>/v1/traces as binary protobuf on
    one connection, with the configured headers and gzip; opentelemetry-proto reads what arrives. A collector
    that refuses a batch (here a wrong path: 404) loses that batch, counted and logged, and nothing else."""
    sink = OTLPSink(protocol="http/protobuf").start()
    try:
        for k, v in sink.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=a%20b,authorization=Bearer t")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        t = tracing.Tracing("http-test")
        try:
            assert t.batcher.export.endpoint == sink.endpoint + "/v1/traces"
            for i in range(300):
                root = t.span("POST /v1/completions", kind="server", attributes={"i": i, "m": "tiny"})
                tracing.end(t.span("router.attempt", root, "client"), generated_tokens=i)
                tracing.end(root)
        finally:
            t.shutdown()
        assert sink.count == 600 and t.batcher.failed == 0
        spans = [s for _, s in sink.spans]
        roots = {s.span_id: s for s in spans if s.name == "POST /v1/completions"}
        assert sorted(a.value.int_value for s in roots.values() for a in s.attributes if a.key == "i") == list(range(300))
        assert all(s.parent_span_id in roots for s in spans if s.name == "router.attempt")
        h = {k.lower(): v for k, v in sink.requests[0].items()}
        assert h["x-tenant"] == "a b" and h["authorization"] == "Bearer t" and h["content-encoding"] == "gzip"

        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", sink.endpoint + "/not-traces")
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_COMPRESSION")
        t = tracing.Tracing("http-refused")
        try:
            for _ in range(5):
                tracing.end(t.span("r"))
        finally:
            t.shutdown()
        assert t.batcher.failed == 5 and sink.count == 600
    finally:
        sink.stop()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "collector:4318")
    with pytest.raises(ValueError, match="http:// or https://"):
        tracing.Tracing("bad")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd")
    with pytest.raises(ValueError, match="zstd"):
        tracing.Tracing("bad")


def test_sampling_follows_the_parent_and_the_ratio(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    t = tracing.Tracing("s")
    try:
        roots = [t.span("r") for _ in range(4000)]
        share = sum(s.ctx.sampled for s in roots) / len(roots)
        assert 0.2 < share < 0.3, share
        assert t.span("c", t.extract(f"00-{TRACE_ID}-{CALLER_SPAN}-01")).ctx.sampled  # a sampled parent: kept
        assert not t.span("c", t.extract(f"00-{TRACE_ID}-{CALLER_SPAN}-00")).ctx.sampled
        child = t.span("c", roots[0])
        assert child.ctx.sampled == roots[0].ctx.sampled and child.ctx.trace_id == roots[0].ctx.trace_id
        assert t.traceparent(child) == f"00-{child.ctx.trace_id:032x}-{child.ctx.span_id:016x}-" + (
            "01" if child.ctx.sampled else "00")
        for bad in ("", "garbage", f"00-{'0' * 32}-{CALLER_SPAN}-01", f"ff-{TRACE_ID}-{CALLER_SPAN}-01",
                    f"00-{TRACE_ID}-{CALLER_SPAN}-01-extra"):
            assert t.extract(bad) is None, bad
        for s in roots:
            s.end()
        assert len(t.batcher.queue) <= t.batcher.max_queue
    finally:
        t.shutdown()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "sometimes")
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER"):
        tracing.Tracing("s")
