"""OpenTelemetry traces: one disaggregated request's spans from the router, the decode worker, the prefill
worker and the KV transfer, under the caller's `traceparent`, received by a real OTLP/gRPC endpoint
(opentelemetry-proto's TraceService); tracing off unless the standard OTEL_* variables ask for it."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from procs import address, base_url, start_router, start_worker

from common import tracing
from loadtest.otlp_sink import OTLPSink

MODEL = "tiny"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def receiver():
    sink = OTLPSink().start()
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
    with pytest.raises(ValueError, match="gRPC"):
        tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})


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
        want = {"POST /v1/chat/completions", "router.admission", "router.placement", "router.attempt",
                "decode.generate", "decode.queue", "decode.prefill", "decode.stream", "prefill.prefill",
                "prefill.queue", "prefill.compute", "kv.transfer"}
        deadline = time.monotonic() + 30
        while {s.name for _, s in receiver.spans} < want and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        router.stop()
        pre.stop()
        dec.stop()
    spans = {s.name: (service, s) for service, s in receiver.spans}
    assert set(spans) >= want, sorted(spans)
    assert {s.trace_id.hex() for _, s in receiver.spans} == {TRACE_ID}  # one trace, the caller's

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
    for name in ("router.admission", "router.placement", "router.attempt"):
        assert parent(name) == sid(root), name
    assert parent("decode.generate") == sid("router.attempt")
    for name in ("decode.queue", "decode.prefill", "decode.stream"):
        assert parent(name) == sid("decode.generate"), name
    assert parent("prefill.prefill") == sid("decode.prefill")
    for name in ("prefill.queue", "prefill.compute", "kv.transfer"):
        assert parent(name) == sid("prefill.prefill"), name
    assert {n: spans[n][0] for n in (root, "decode.generate", "prefill.prefill")} == {
        root: "splitfire-router", "decode.generate": "splitfire-decode", "prefill.prefill": "splitfire-prefill"}
    placement = attrs("router.placement")
    assert placement["splitfire.decode"] == address(dec) and placement["splitfire.prefill"] == address(pre)
    assert "splitfire.decode.cost" in placement and "splitfire.prefill.expected_cached_blocks" in placement
    transfer = attrs("kv.transfer")
    assert transfer["splitfire.bytes"] > 0 and transfer["splitfire.layers"] == 2 and transfer["splitfire.blocks"] >= 1
    assert attrs(root)["http.response.status_code"] == 200 and attrs(root)["splitfire.completion_tokens"] == 4
    assert any(e.name == "first_token" for e in spans["decode.generate"][1].events)
    s = spans["decode.stream"][1]
    assert spans["decode.generate"][1].start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano
