"""A tiny OTLP/HTTP trace collector on 127.0.0.1 for tests and benchmarks: it keeps every span exported to it."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    role: str  # the exporting process's tandem.role resource attribute: ingress, prefill or decode
    attributes: dict


class OTLPCollector:
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    collector._receive(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> OTLPCollector:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def spans_with(self, request_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.attributes.get("tandem.request_id") == request_id]

    def _receive(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {a.key: _value(a.value) for a in span.attributes}
                    received.append(ReceivedSpan(span.name, span.trace_id.hex(), span.span_id.hex(),
                                                 span.parent_span_id.hex(), resource.get("tandem.role", ""),
                                                 attributes))
        with self.lock:
            self.spans.extend(received)


def _value(value):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
