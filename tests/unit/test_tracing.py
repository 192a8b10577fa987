"""telemetry.tracing against real OTLP receivers (HTTP/protobuf and gRPC) in this process."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from telemetry.tracing import TraceConfig, Tracing, end_span
from tests.integration.otlp_receiver import OtlpReceiver
from tests.waiting import wait_until


def test_disabled_tracing_makes_nothing() -> None:
    tracing = Tracing()
    assert not tracing.enabled
    assert tracing.start_span("router", {}) is None
    assert tracing.carrier(None) == {}
    assert tracing.span_between("decode", {"traceparent": "x"}, 0.0, 1.0) is None
    tracing.flush()
    tracing.shutdown()


def test_http_export_links_child_to_carrier() -> None:
    receiver = OtlpReceiver()
    tracing = Tracing(TraceConfig(endpoint=receiver.url), "router")
    try:
        root = tracing.start_span("router", {}, attributes={"gen_ai.request.model": "m"})
        carrier = tracing.carrier(root)
        assert carrier["traceparent"].startswith("00-")
        now = time.monotonic()
        tracing.span_between("prefill.compute", carrier, now - 0.5, now, {"gen_ai.usage.input_tokens": 7})
        end_span(root)
        tracing.flush()
        receiver.wait(lambda: len(receiver.spans) == 2, 10)
        spans = {s.name: s for s in receiver.spans}
        child, parent = spans["prefill.compute"], spans["router"]
        assert child.parent_id == parent.span_id and child.trace_id == parent.trace_id
        assert parent.parent_id == "" and parent.attrs["gen_ai.request.model"] == "m"
        assert 0.45e9 < child.end_ns - child.start_ns < 0.55e9
        assert child.attrs["gen_ai.usage.input_tokens"] == 7
    finally:
        tracing.shutdown()
        receiver.close()


def test_sample_ratio_zero_sends_no_context() -> None:
    receiver = OtlpReceiver()
    tracing = Tracing(TraceConfig(endpoint=receiver.url, sample_ratio=0.0))
    try:
        span = tracing.start_span("router", {})
        assert tracing.carrier(span) == {}
        end_span(span)
        tracing.flush()
        assert receiver.spans == []
    finally:
        tracing.shutdown()
        receiver.close()


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.names: list[str] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802 (gRPC's name)
               context: object) -> trace_service_pb2.ExportTraceServiceResponse:
        self.names += [s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def test_grpc_export() -> None:
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tracing = Tracing(TraceConfig(endpoint=f"127.0.0.1:{port}", protocol="grpc"))
    try:
        end_span(tracing.start_span("router", {}))
        tracing.flush()
        wait_until(lambda: collector.names, 10, "a span exported over gRPC")
        assert collector.names == ["router"]
    finally:
        tracing.shutdown()
        server.stop(0)
