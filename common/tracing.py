"""OpenTelemetry traces of one request across the router, the decode worker, the prefill worker and the
KV transfer, exported over OTLP (HTTP with binary protobuf, or gRPC).

Off unless an OTLP endpoint is configured with the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp`); `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` keep it off. Off, each call site tests one `None`. On, these are read as the
specification says: `OTEL_TRACES_SAMPLER` / `_ARG` (`always_on`, `always_off`, `traceidratio`, and the
`parentbased_` ones; default `parentbased_always_on`), `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` (`http/protobuf`,
the default, or `grpc`), `_HEADERS`, `_INSECURE`, `_CERTIFICATE`, `_COMPRESSION` (`gzip`), `_TIMEOUT` (ms),
`OTEL_BSP_SCHEDULE_DELAY`, `_MAX_QUEUE_SIZE`, `_MAX_EXPORT_BATCH_SIZE` (spans leave in batches on a thread of
their own), `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (the service name defaults to the process's:
splitfire-router, splitfire-decode, ...).

Why not the OpenTelemetry SDK: its spans cost ~35 us each to make and ~50 us each to encode on the 2-vCPU
development VM, which doubled the router's CPU per request with every request traced. A span here is a
slotted object and its export hand-written protobuf (`encode_request`); the proto types of
`opentelemetry-proto` are the tests' oracle for that encoding, and a real OTLP receiver built on them the
tests' collector.

The context travels as a W3C `traceparent`: from the client's HTTP header into the router, and from the
router to the decode worker and on to the prefill worker in the request message itself
(`GenerateRequest.traceparent`, `PrefillRequest.traceparent`) — the router reaches a worker over gRPC, an
HTTP frame stream or one multiplexed connection for many requests, and only the message is common to all. gRPC
calls carry it as metadata too (`Tracing.incoming` reads either), and the router sends it to an OpenAI-compatible
upstream as its `traceparent` header.

Each process holds its own `Tracing` (no global tracer).
"""

from __future__ import annotations

import logging
import os
import random
import struct
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("splitfire.tracing")

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
             "parentbased_traceidratio")
KINDS = {"internal": 1, "server": 2, "client": 3}
_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces (see the module's docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if exporter not in ("", "otlp"):
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter!r} is not supported: splitfire exports traces over OTLP "
                         "(otlp) or not at all (none)")
    protocol(env)
    return exporter == "otlp" or any(env.get(v) for v in _ENDPOINT_VARS)


def wall_ns(perf_s: float) -> int:
    """A `time.perf_counter()` reading as Unix-epoch nanoseconds (a span's start or end)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


# -- spans -------------------------------------------------------------------------------


class SpanContext:
    """A span's identity: what a child is parented on, and what a `traceparent` carries."""

    __slots__ = ("sampled", "span_id", "trace_id", "trace_state")

    def __init__(self, trace_id: int, span_id: int, sampled: bool, trace_state: str = ""):
        self.trace_id, self.span_id, self.sampled, self.trace_state = trace_id, span_id, sampled, trace_state


class Span:
    __slots__ = ("attributes", "ctx", "end_ns", "events", "kind", "name", "parent_id", "start_ns", "status",
                 "tracing")

    def __init__(self, tracing: Tracing, name: str, ctx: SpanContext, parent_id: int, kind: int, start_ns: int,
                 attributes: dict[str, Any] | None):
        self.tracing, self.name, self.ctx, self.parent_id, self.kind = tracing, name, ctx, parent_id, kind
        self.start_ns, self.end_ns = start_ns, 0
        self.attributes = attributes if attributes is not None else {}
        self.events: list[tuple[int, str]] = []
        self.status: str | None = None  # an error's message

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str, timestamp: int | None = None) -> None:
        self.events.append((timestamp or time.time_ns(), name))

    def end(self, end_time: int | None = None) -> None:
        if self.end_ns:
            return
        self.end_ns = end_time or time.time_ns()
        if self.ctx.sampled:
            self.tracing.batcher.add(self)


# -- sampling ----------------------------------------------------------------------------


class Sampler:
    """OTEL_TRACES_SAMPLER: whether a new span is recorded. A trace-id ratio compares the low 64 bits of the
    trace id with ratio * 2^64 (the specification's rule, so every process agrees on a trace)."""

    def __init__(self, name: str, arg: str):
        if name not in _SAMPLERS:
            raise ValueError(f"OTEL_TRACES_SAMPLER={name!r} is not supported ({', '.join(_SAMPLERS)})")
        self.parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        ratio = 1.0 if root == "always_on" else 0.0 if root == "always_off" else None
        if ratio is None:
            try:
                ratio = float(arg) if arg else 1.0
            except ValueError:
                raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a ratio") from None
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} must be between 0 and 1")
        self.bound = round(ratio * 2**64)

    def sampled(self, trace_id: int, parent: SpanContext | None) -> bool:
        if parent is not None and self.parent_based:
            return parent.sampled
        return (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < self.bound


# -- OTLP encoding (protobuf by hand) ----------------------------------------------------


_SMALL = [bytes([i]) for i in range(128)]
_TAGS = {n: bytes([n << 3 | 2]) for n in range(1, 16)}  # length-delimited fields 1-15: one tag byte
_PACK_D, _PACK_Q = struct.Struct("<d").pack, struct.Struct("<Q").pack


def _varint(n: int) -> bytes:
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (strings, bytes, messages)."""
    n = len(payload)
    tag = _TAGS.get(number) or _varint(number << 3 | 2)
    return tag + (_SMALL[n] if n < 128 else _varint(n)) + payload


def _any(value: Any) -> bytes:
    """An AnyValue: string 1, bool 2, int64 3, double 4, array 5."""
    if value.__class__ is str:
        raw = value.encode()
        n = len(raw)
        return b"\x0a" + (_SMALL[n] if n < 128 else _varint(n)) + raw
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFF_FFFF_FFFF_FFFF)
    if isinstance(value, float):
        return b"\x21" + _PACK_D(value)
    if isinstance(value, (list, tuple)):
        return _field(5, b"".join(_field(1, _any(v)) for v in value))
    return _field(1, str(value).encode())


def _kv(key: str, value: Any) -> bytes:
    """A `KeyValue` message (a resource's attribute, and inside a span's)."""
    return _field(1, key.encode()) + _field(2, _any(value))


def _attribute(key: str, value: Any) -> bytes:
    """A span's attribute field (Span.attributes, 9), the plain way: what `_Key`'s fast paths must equal."""
    return _field(9, _kv(key, value))


class _Key:
    """One attribute key's encodings, made once (keys repeat on every span): the head of the field for an int
    of each varint length and for a float (the value's bytes follow), both bools, and the whole fields of the
    first 64 distinct strings (model, tenant, route, endpoints, results repeat; a key with more values, such as
    an id, stops memoising). (Encoding was 77 us of the router's CPU per traced request on a 2-vCPU EPYC before
    memos; `test_tracing` holds these to `_attribute`.)"""

    __slots__ = ("bools", "float", "ints", "key", "strs")

    def __init__(self, key: str):
        self.key = key
        k = _field(1, key.encode())
        self.ints = [b""] + [b"\x4a" + _varint(len(k) + 3 + n) + k + b"\x12" + _SMALL[1 + n] + b"\x18"
                             for n in range(1, 11)]  # by the value's varint length
        self.float = b"\x4a" + _varint(len(k) + 11) + k + b"\x12\x09\x21"
        self.bools = (_attribute(key, False), _attribute(key, True))
        self.strs: dict[str, bytes] | None = {}

    def string(self, value: str) -> bytes:
        hit = _attribute(self.key, value)
        strs = self.strs
        if strs is not None:
            if len(strs) < 64:
                strs[value] = hit
            else:
                self.strs = None
        return hit


_KEYS: dict[str, _Key] = {}  # attribute key -> its encodings (bounded, should keys ever carry values)
_NAMED: dict[tuple[str, int], bytes] = {}  # (span name, kind) -> its name and kind fields
_EVENTS: dict[str, bytes] = {}  # event name -> its Event.name field
_FLAGS = (b"\x85\x01" + struct.pack("<I", 0), b"\x85\x01" + struct.pack("<I", 1))  # the W3C trace flags


def _key(key: str) -> _Key:
    k = _KEYS.get(key)
    if k is None:
        k = _Key(key)
        if len(_KEYS) < 4096:
            _KEYS[key] = k
    return k


def encode_attributes(attributes: Mapping[str, Any], out: list[bytes]) -> None:
    """A span's attribute fields appended to `out`, None values left out: strings, bools, ints from 0 to
    2^64 - 1 and floats through their key's `_Key` (no call per attribute on a memo hit), anything else (lists,
    negative ints) through `_attribute`."""
    keys = _KEYS
    for k, v in attributes.items():
        cls = v.__class__
        if cls is str:
            e = keys.get(k) or _key(k)
            strs = e.strs
            out.append((strs.get(v) if strs is not None else None) or e.string(v))
        elif cls is int and 0 <= v <= 0xFFFF_FFFF_FFFF_FFFF:
            b = _SMALL[v] if v < 128 else _varint(v)
            out += ((keys.get(k) or _key(k)).ints[len(b)], b)
        elif cls is float:
            out += ((keys.get(k) or _key(k)).float, _PACK_D(v))
        elif cls is bool:
            out.append((keys.get(k) or _key(k)).bools[v])
        elif v is not None:
            out.append(_attribute(k, v))


def encode_span(s: Span) -> bytes:
    """An OTLP `Span` message. (Fields in number order; ids, times and flags are fixed-size and written
    directly; test_tracing holds the whole to opentelemetry-proto's reading.)"""
    ctx = s.ctx
    out = [b"\x0a\x10", ctx.trace_id.to_bytes(16, "big"), b"\x12\x08", ctx.span_id.to_bytes(8, "big")]
    if ctx.trace_state:
        out.append(_field(3, ctx.trace_state.encode()))
    if s.parent_id:
        out += (b"\x22\x08", s.parent_id.to_bytes(8, "big"))
    named = _NAMED.get((s.name, s.kind))
    if named is None:
        named = _field(5, s.name.encode()) + b"\x30" + _SMALL[s.kind]
        if len(_NAMED) < 4096:
            _NAMED[(s.name, s.kind)] = named
    out += (named, b"\x39", _PACK_Q(s.start_ns), b"\x41", _PACK_Q(s.end_ns))
    encode_attributes(s.attributes, out)
    for ts, name in s.events:
        ev = _EVENTS.get(name)
        if ev is None:
            ev = _field(2, name.encode())
            if len(_EVENTS) < 4096:
                _EVENTS[name] = ev
        out += (b"\x5a", _SMALL[9 + len(ev)] if len(ev) < 119 else _varint(9 + len(ev)), b"\x09", _PACK_Q(ts), ev)
    if s.status is not None:
        out.append(_field(15, _field(2, s.status.encode()) + b"\x18\x02"))  # STATUS_CODE_ERROR
    out.append(_FLAGS[ctx.sampled])
    return b"".join(out)


def encode_request(resource: Mapping[str, Any], scope: str, spans: list[Span]) -> bytes:
    """An `ExportTraceServiceRequest` of one resource's spans under one instrumentation scope."""
    return request_of(resource, scope, [encode_span(s) for s in spans])


def request_of(resource: Mapping[str, Any], scope: str, encoded: list[bytes]) -> bytes:
    """`encode_request` of spans already encoded (`encode_span`)."""
    res = _field(1, b"".join(_field(1, _kv(k, v)) for k, v in resource.items()))
    scope_spans = _field(1, _field(1, scope.encode())) + b"".join(_field(2, s) for s in encoded)
    return _field(1, res + _field(2, scope_spans))


# -- export ------------------------------------------------------------------------------


def _pairs(text: str) -> dict[str, str]:
    """`k=v,k2=v2` (OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS), values percent-decoded."""
    out = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip():
            out[k.strip()] = urllib.parse.unquote(v.strip())
    return out


def _env(name: str, default: str = "") -> str:
    """The traces-specific variable, else the general one (OTEL_EXPORTER_OTLP_TRACES_X, OTEL_EXPORTER_OTLP_X)."""
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}") or default


def protocol(env: Mapping[str, str] | None = None) -> str:
    """OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL: `http/protobuf` (the default, as the specification recommends:
    the cheaper for the serving process, docs/benchmarks/tenants.md) or `grpc`; anything else fails, naming it."""
    env = os.environ if env is None else env
    name = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    name = name.strip().lower()
    if name not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTLP protocol {name!r} is not supported: splitfire exports OTLP over HTTP (http/protobuf, "
                         "the default: the collector's port 4318) or gRPC (grpc: port 4317); set "
                         "OTEL_EXPORTER_OTLP_PROTOCOL to one of them")
    return name


def _compression() -> str:
    """OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION: `gzip` or none."""
    name = _env("COMPRESSION", "none").strip().lower()
    if name not in ("gzip", "none"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_COMPRESSION={name!r} is not supported (gzip or none)")
    return name


class GrpcExport:
    """One `ExportTraceServiceRequest` per call over OTLP/gRPC (`TraceService/Export`)."""

    def __init__(self, timeout_s: float, headers: tuple[tuple[str, str], ...]):
        import grpc

        endpoint = _env("ENDPOINT", "http://localhost:4317")
        # The scheme decides when there is one (https: TLS, http: plaintext); without one, _INSECURE does.
        url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
        target = url.netloc or url.path
        insecure = url.scheme == "http" if url.scheme else _env("INSECURE").lower() == "true"
        if insecure:
            channel = grpc.insecure_channel(target)
        else:
            cert = _env("CERTIFICATE")
            creds = grpc.ssl_channel_credentials(open(cert, "rb").read() if cert else None)
            channel = grpc.secure_channel(target, creds)
        self.endpoint = endpoint
        self.channel = channel
        self.call = channel.unary_unary(_EXPORT)  # (bytes in, bytes out: the encoding is ours)
        self.timeout_s, self.metadata = timeout_s, headers or None
        self.compression = grpc.Compression.Gzip if _compression() == "gzip" else None

    def __call__(self, body: bytes) -> None:
        self.call(body, timeout=self.timeout_s, metadata=self.metadata, compression=self.compression)

    @staticmethod
    def reason(e: Exception) -> str:
        import grpc

        return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) and hasattr(e, "code") else repr(e)

    def close(self) -> None:
        self.channel.close()


class HttpExport:
    """One `ExportTraceServiceRequest` per POST over OTLP/HTTP (binary protobuf) on one kept-alive
    connection: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as it is, else `OTEL_EXPORTER_OTLP_ENDPOINT` +
    `/v1/traces`, else http://localhost:4318/v1/traces (the specification's rules). Fewer CPU-microseconds a
    span than the gRPC call: one write and one read of a plain connection."""

    def __init__(self, timeout_s: float, headers: tuple[tuple[str, str], ...]):
        url = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        if not url:
            base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or "http://localhost:4318"
            url = base.rstrip("/") + "/v1/traces"
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"OTLP/HTTP endpoint {url!r} must be an http:// or https:// URL")
        self.endpoint = url
        self.tls = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.tls else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout_s = timeout_s
        self.gzip = _compression() == "gzip"
        self.headers = {"Content-Type": "application/x-protobuf", **dict(headers)}
        if self.gzip:
            self.headers["Content-Encoding"] = "gzip"
        self.conn: Any = None

    def _connect(self) -> Any:
        import http.client

        if not self.tls:
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        import ssl

        ctx = ssl.create_default_context(cafile=_env("CERTIFICATE") or None)
        return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s, context=ctx)

    def __call__(self, body: bytes) -> None:
        if self.gzip:
            import gzip

            body = gzip.compress(body, compresslevel=1)
        if self.conn is None:
            self.conn = self._connect()
        try:
            self.conn.request("POST", self.path, body, self.headers)
            resp = self.conn.getresponse()
            answer = resp.read()
        except BaseException:
            self.close()  # (the next batch connects again)
            raise
        if not 200 <= resp.status < 300:
            raise RuntimeError(f"HTTP {resp.status} {resp.reason}: {answer[:200]!r}")

    @staticmethod
    def reason(e: Exception) -> str:
        return str(e) if isinstance(e, RuntimeError) else repr(e)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Batcher:
    """Finished spans, exported in batches by a thread of its own every schedule delay (or sooner when a batch
    is full) over OTLP/gRPC or OTLP/HTTP (`protocol`); spans beyond the queue's size are dropped and counted,
    never waited for."""

    def __init__(self, resource: Mapping[str, Any]):
        headers = tuple((k.lower(), v) for k, v in _pairs(_env("HEADERS")).items())
        self.timeout_s = float(_env("TIMEOUT", "10000")) / 1000
        self.protocol = protocol()
        self.export: GrpcExport | HttpExport = (GrpcExport if self.protocol == "grpc" else HttpExport)(
            self.timeout_s, headers)
        self.delay_s = float(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "5000")) / 1000
        self.max_queue = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048"))
        self.max_batch = int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512"))
        self.resource = dict(resource)
        self.queue: deque[bytes] = deque()  # encoded spans
        self.dropped = 0
        self.failed = 0
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self.thread.start()

    def add(self, span: Span) -> None:
        """Queue a finished span, encoded now: a queue of bytes (~300 B a span) holds nothing the garbage
        collector follows, where up to `max_queue` span objects with their dicts and lists stayed in every
        collection of the serving process until exported; the export thread then runs only the call."""
        if len(self.queue) >= self.max_queue:
            self.dropped += 1
            return
        self.queue.append(encode_span(span))
        if len(self.queue) == self.max_batch:  # (once as it fills: a flush under way drains all it finds)
            self.wake.set()

    def _run(self) -> None:
        while not self.stopping:
            self.wake.wait(self.delay_s)
            self.wake.clear()
            self.flush()

    def flush(self) -> None:
        while self.queue:
            batch = [self.queue.popleft() for _ in range(min(len(self.queue), self.max_batch))]
            try:
                self.export(request_of(self.resource, "splitfire", batch))
            except Exception as e:  # a collector away: these spans are lost, said once per batch, serving goes on
                self.failed += len(batch)
                log.warning("event=trace_export_failed spans=%d failed_total=%d dropped_total=%d error=%r",
                            len(batch), self.failed, self.dropped, self.export.reason(e))

    def shutdown(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=self.timeout_s + 1)
        self.flush()
        self.export.close()


# -- the tracer --------------------------------------------------------------------------


class Tracing:
    """One process's tracer. `span` starts a span (ended by the caller, with `end`), `traceparent` is the
    header form of a span's context, `extract` reads one."""

    def __init__(self, service: str, resource: Mapping[str, Any] | None = None):
        self.sampler = Sampler(os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower(),
                               os.environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip())
        res: dict[str, Any] = {"telemetry.sdk.name": "splitfire", "telemetry.sdk.language": "python",
                               **(resource or {}), **_pairs(os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))}
        res["service.name"] = os.environ.get("OTEL_SERVICE_NAME") or res.get("service.name") or service
        self.service = res["service.name"]
        self.batcher = Batcher(res)
        self._rand = random.Random()

    @classmethod
    def from_env(cls, service: str, resource: Mapping[str, Any] | None = None) -> Tracing | None:
        """A tracer when the environment asks for one (`wanted`), else None. A bad setting fails here, at start.
        `resource`: the process's own attributes, on every span it exports (what never changes per request:
        sent once per batch, not once per span); OTEL_RESOURCE_ATTRIBUTES override them."""
        if not wanted():
            return None
        t = cls(service, resource)
        log.info("event=tracing_on service=%s protocol=%s endpoint=%s sampler=%s", t.service, t.batcher.protocol,
                 t.batcher.export.endpoint, os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"))
        return t

    @staticmethod
    def extract(traceparent: str | None, tracestate: str | None = None) -> SpanContext | None:
        """The context a W3C `traceparent` names (`00-<32 hex>-<16 hex>-<2 hex>`); None when it is missing or
        malformed (a new trace starts)."""
        if not traceparent:
            return None
        parts = traceparent.strip().split("-")
        if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16 \
                or len(parts[3]) != 2 or (parts[0] == "00" and len(parts) != 4):
            return None
        try:
            trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
        except ValueError:
            return None
        if not trace_id or not span_id:
            return None
        return SpanContext(trace_id, span_id, bool(flags & 1), (tracestate or "").strip())

    @staticmethod
    def incoming(field: str, context: Any) -> str:
        """A gRPC call's `traceparent`: its message's field (what splitfire's own callers set, on every transport),
        else the call's metadata's — where a client instrumented by OpenTelemetry's gRPC interceptors puts it."""
        if field:
            return field
        metadata = getattr(context, "invocation_metadata", None)  # (the HTTP and mux streams' contexts have none)
        for key, value in (metadata() or ()) if metadata is not None else ():
            if key == "traceparent":
                return value if isinstance(value, str) else value.decode("latin-1")
        return ""

    def span(self, name: str, parent: Span | SpanContext | None = None, kind: str = "internal",
             attributes: dict[str, Any] | None = None, start_s: float | None = None) -> Span:
        """Start a span under `parent` (a span, a context from `extract`, or None: a new trace). `start_s`: a
        `perf_counter()` reading when the span began before now."""
        pctx = parent.ctx if isinstance(parent, Span) else parent
        r = self._rand
        if pctx is not None:
            trace_id, sampled, state = pctx.trace_id, self.sampler.sampled(pctx.trace_id, pctx), pctx.trace_state
        else:
            trace_id = r.getrandbits(128) or 1
            sampled, state = self.sampler.sampled(trace_id, None), ""
        ctx = SpanContext(trace_id, r.getrandbits(64) or 1, sampled, state)
        start = time.time_ns() if start_s is None else wall_ns(start_s)
        return Span(self, name, ctx, pctx.span_id if pctx is not None else 0, KINDS[kind], start, attributes)

    @staticmethod
    def traceparent(span: Span) -> str:
        c = span.ctx
        return "-".join(("00", c.trace_id.to_bytes(16, "big").hex(), c.span_id.to_bytes(8, "big").hex(),
                         "01" if c.sampled else "00"))

    def shutdown(self) -> None:
        """Export what is still queued and stop (a process's exit)."""
        self.batcher.shutdown()


def grpc_metadata(traceparent: str) -> tuple[tuple[str, str], ...] | None:
    """The metadata of a gRPC call carrying `traceparent` beside its message (None: not traced), for proxies and
    meshes that read it there; `Tracing.incoming` is the other side."""
    return (("traceparent", traceparent),) if traceparent else None


_NAMES: dict[str, str] = {}  # `end`'s keyword -> its attribute's name


def end(span: Span, end_s: float | None = None, error: str | None = None, **attributes: Any) -> None:
    """End `span` (at a `perf_counter()` reading, or now) with more attributes; `error` marks it failed."""
    if attributes:
        names, into = _NAMES, span.attributes
        for k, v in attributes.items():
            if v is not None:
                name = names.get(k)
                if name is None:
                    name = k if k.startswith(("splitfire.", "http.", "rpc.")) else f"splitfire.{k}"
                    if len(names) < 4096:
                        names[k] = name
                into[name] = v
    if error is not None:
        span.status = error
    span.end(None if end_s is None else wall_ns(end_s))
