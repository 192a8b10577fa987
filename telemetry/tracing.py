"""OpenTelemetry tracing shared by the router and the workers: one trace per request across processes.

``TraceConfig`` (msgspec, so it crosses to Ray actors as bytes) says where spans
go; ``Tracing(config, service)`` owns one ``TracerProvider`` (no process-global
state) exporting over OTLP (``http/protobuf`` or ``grpc``) through a
``BatchSpanProcessor`` with a short schedule delay. With no endpoint
``Tracing.enabled`` is False and every method returns at once without touching
opentelemetry (which is imported only when an endpoint is set).

The W3C context travels in ``GenerateRequest.trace_context`` (a
``traceparent``/``tracestate`` dict). Workers make spans only for requests that
carry one, so a router that samples a request out (``--otlp-traces-sample-ratio``)
or has tracing off costs the workers nothing. Spans are made at role boundaries
from timestamps the roles already keep (``span_between``), never inside the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import msgspec

PROTOCOLS = ("http/protobuf", "grpc")
SCHEDULE_DELAY_MS = 200
AttrValue = str | bool | int | float | list[str]


class TraceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where spans go: ``endpoint=None`` disables tracing. For ``http/protobuf`` the endpoint is the
    full URL (``http://host:4318/v1/traces``); for ``grpc`` it is ``host:4317`` or ``http://host:4317``."""

    endpoint: str | None = None
    protocol: str = "http/protobuf"
    sample_ratio: float = 1.0
    service_name: str = "pdserve"

    @classmethod
    def from_env(cls, endpoint: str | None = None, protocol: str | None = None,
                 sample_ratio: float | None = None, env: Mapping[str, str] | None = None) -> TraceConfig:
        """Explicit values win, then the standard ``OTEL_*`` variables:
        ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces`` for
        HTTP), ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``,
        ``OTEL_TRACES_SAMPLER_ARG`` and ``OTEL_SERVICE_NAME``."""
        env = os.environ if env is None else env
        proto = (protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                 or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
        if proto not in PROTOCOLS:
            raise ValueError(f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, not {proto!r}")
        url = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not url and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            base = env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/")
            url = base if proto == "grpc" else f"{base}/v1/traces"
        try:
            ratio = sample_ratio if sample_ratio is not None else float(env.get("OTEL_TRACES_SAMPLER_ARG", 1))
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], not "
                             f"{env['OTEL_TRACES_SAMPLER_ARG']!r}") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"trace sample ratio must be within [0, 1], not {ratio}")
        return cls(endpoint=url or None, protocol=proto, sample_ratio=ratio,
                   service_name=env.get("OTEL_SERVICE_NAME", "pdserve"))


def wall_ns(monotonic: float) -> int:
    """A ``time.monotonic()`` stamp as epoch nanoseconds (span times are wall-clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


class Tracing:
    """One role's tracer. ``enabled`` is False without an endpoint; then nothing is exported."""

    def __init__(self, config: TraceConfig | None = None, role: str = "router") -> None:
        self.config = config or TraceConfig()
        self.enabled = self.config.endpoint is not None
        self._provider: Any = None
        self._tracer: Any = None
        if self.enabled:
            self._start(role)

    def _start(self, role: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        cfg = self.config
        if cfg.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            target = cfg.endpoint or ""
            exporter: Any = Grpc(endpoint=target, insecure=not target.startswith("https://"))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

            exporter = Http(endpoint=cfg.endpoint)
        resource = Resource.create({"service.name": cfg.service_name, "pdserve.role": role,
                                    "openinference.project.name": cfg.service_name})
        self._provider = TracerProvider(resource=resource,
                                        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=SCHEDULE_DELAY_MS)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("pdserve")

    def start_span(self, name: str, parent: Mapping[str, str] | Any = None, start_ns: int | None = None,
                   attributes: Mapping[str, AttrValue] | None = None) -> Any:
        """A started span (finish it with ``end_span``), or None when disabled.

        ``parent`` is a W3C carrier (a message's ``trace_context`` or the HTTP headers: without a
        ``traceparent`` the span is a root), a span, or None (a root)."""
        if not self.enabled:
            return None
        ctx = self._context(parent)
        return self._tracer.start_span(name, context=ctx, start_time=start_ns, attributes=attributes)

    def span_between(self, name: str, parent: Mapping[str, str] | Any, start: float, end: float,
                     attributes: Mapping[str, AttrValue] | None = None, error: str | None = None) -> Any:
        """A finished span from two ``time.monotonic()`` stamps; None when disabled or without parent."""
        if not self.enabled or not parent:
            return None
        span = self.start_span(name, parent, wall_ns(start), attributes)
        end_span(span, error, wall_ns(end))
        return span

    def carrier(self, span: Any) -> dict[str, str]:
        """The W3C context of ``span`` as a dict for a message; empty when disabled or not sampled."""
        if span is None or not span.get_span_context().trace_flags.sampled:
            return {}
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        out: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(out, context=set_span_in_context(span))
        return out

    def _context(self, parent: Mapping[str, str] | Any) -> Any:
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if parent is None:
            return None
        if isinstance(parent, Mapping):
            return TraceContextTextMapPropagator().extract(dict(parent))
        return set_span_in_context(parent)

    def flush(self, timeout_ms: int = 5000) -> None:
        if self._provider is not None:
            self._provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self.enabled = False


def end_span(span: Any, error: str | None = None, end_ns: int | None = None) -> None:
    """End ``span`` (None is ignored), marking it as an error with ``error`` as description."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)

