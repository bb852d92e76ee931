"""An OTLP trace endpoint in this process, over gRPC (opentelemetry-proto's TraceService) or HTTP (binary
protobuf POSTed to /v1/traces, read with opentelemetry-proto's types): keeps what it is sent as
(service.name, span) pairs, or only counts them. The tests' receiver and the benchmarks' collector.

    sink = OTLPSink(keep=False).start()                      # or OTLPSink(protocol="http/protobuf")
    env = sink.env()                                         # the OTEL_* variables that point a process here
"""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from loadtest.stack import free_port


class OTLPSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep: bool = True, protocol: str = "grpc"):
        if protocol not in ("grpc", "http/protobuf"):
            raise ValueError(f"protocol {protocol!r}: grpc or http/protobuf")
        self.keep, self.protocol = keep, protocol
        self.spans: list[tuple[str, Any]] = []
        self.count = 0
        self.requests: list[dict[str, str]] = []  # the HTTP requests' headers (http/protobuf, when kept)
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None
        self.endpoint = ""

    def Export(self, request, context):
        self._take(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def _take(self, request: Any) -> None:
        got = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                got += [(service, s) for s in ss.spans]
        with self._lock:
            self.count += len(got)
            if self.keep:
                self.spans += got

    def start(self) -> OTLPSink:
        port = free_port()
        if self.protocol == "grpc":
            self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
            self._server.add_insecure_port(f"127.0.0.1:{port}")
            self._server.start()
        else:
            self._http = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
            self._http.daemon_threads = True
            threading.Thread(target=self._http.serve_forever, name="otlp-http-sink", daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def env(self) -> dict[str, str]:
        """The standard variables that point a process's traces here (batches leave every 100 ms)."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
                "OTEL_EXPORTER_OTLP_PROTOCOL": self.protocol, "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


def _handler(sink: OTLPSink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # (keep-alive: the exporter's one connection)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                self._answer(404 if self.path != "/v1/traces" else 415, b"")
                return
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if sink.keep:  # (a counting sink keeps nothing: a benchmark's collector runs for minutes)
                with sink._lock:
                    sink.requests.append(dict(self.headers))
            sink._take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self._answer(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
