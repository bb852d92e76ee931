"""An OTLP/gRPC trace endpoint in this process (opentelemetry-proto's TraceService): keeps what it is sent
as (service.name, span) pairs, or only counts them. The tests' receiver and the benchmarks' collector.

    sink = OTLPSink(keep=False).start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from loadtest.stack import free_port


class OTLPSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep: bool = True):
        self.keep = keep
        self.spans: list[tuple[str, Any]] = []
        self.count = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.endpoint = ""

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                got += [(service, s) for s in ss.spans]
        with self._lock:
            self.count += len(got)
            if self.keep:
                self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> OTLPSink:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = free_port()
        self._server.add_insecure_port(f"127.0.0.1:{port}")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def env(self) -> dict[str, str]:
        """The standard variables that point a process's traces here (batches leave every 100 ms)."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
                "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)
