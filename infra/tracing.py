"""OpenTelemetry tracing of trajbus: one trace per trajectory, from the agent's call to the trainer's fetch.

Off by default, and then nothing is installed: a caller checks ``enabled()`` (one boolean) and does
nothing more. ``configure`` installs this process's tracer provider (its own, not OpenTelemetry's global
one, so a process may configure again after ``shutdown``): spans are exported off the hot path by a
``BatchSpanProcessor`` to ``{prefix}.traces`` (``kafka``, ``infra.trace_export``) and/or OTLP/HTTP
(``otlp``, which honours ``OTEL_EXPORTER_OTLP_ENDPOINT``).

A trajectory's trace is derived from its uid alone (``trajectory_ids``), so every process finds it
without asking anyone: the gateway exports the trajectory's root span with those exact ids
(``export_trajectory_root``), and a process that has no better parent uses ``trajectory_context(uid)``.
The better parent travels in Kafka record headers as W3C ``traceparent`` (``inject_headers`` /
``context_from_headers``); a group record carries one per trajectory (``GROUP_TRACEPARENTS`` of
``streams.wire.headers``).
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from trajbus.infra.span_names import (  # noqa: F401 - the span vocabulary, re-exported: callers write tracing.CALL
    APPLY, BACKEND, CALL, CHANNEL, CONVERT, EMIT, ENGINE, FETCH, OFFSET, OUTCOME, PARTITION, PROMPT_UID, PUBLISH,
    STEP_INDEX, TOKENS, TRAJECTORY, TRAJECTORY_UID)

log = logging.getLogger("trajbus.tracing")

OFF = "off"
KAFKA, OTLP = "kafka", "otlp"
MODES = (KAFKA, OTLP)
TRACEPARENT = "traceparent"
"""The W3C header, on HTTP requests and Kafka records alike (the wire's name: ``streams.wire.headers``)."""

_propagator = TraceContextTextMapPropagator()
_forced_ids: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("trajbus_forced_ids",
                                                                                     default=None)


def parse_modes(text: str) -> str:
    """``off`` or a comma-separated subset of ``kafka,otlp``, normalized (``ValueError`` naming the word)."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if not words or words == [OFF]:
        return OFF
    unknown = [w for w in words if w not in MODES]
    if unknown:
        raise ValueError(f"expected off or a comma-separated list of {', '.join(MODES)}, got {unknown[0]!r}")
    return ",".join(m for m in MODES if m in words)


def trajectory_ids(trajectory_uid: str) -> tuple[int, int]:
    """(trace id, root span id) of a trajectory: the first 16 and next 8 bytes of sha256(uid), never 0."""
    digest = hashlib.sha256(trajectory_uid.encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


def trajectory_context(trajectory_uid: str) -> Context:
    """A context whose current span is the trajectory's root (remote, sampled): the parent of last resort."""
    trace_id, span_id = trajectory_ids(trajectory_uid)
    root = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(root))


@dataclass
class _Installed:
    provider: Any
    tracer: trace.Tracer
    users: int


_lock = threading.Lock()
_installed: _Installed | None = None
_enabled = False


def enabled() -> bool:
    """Whether this process traces: the one check a caller makes when tracing is off."""
    return _enabled


def tracer() -> trace.Tracer:
    """The process's tracer (a no-op one when off)."""
    installed = _installed
    return installed.tracer if installed is not None else trace.NoOpTracer()


class Tracing:
    """What ``configure`` returns: ``shutdown()`` flushes and, for the last user, uninstalls the provider."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def flush(self, timeout_s: float = 10.0) -> bool:
        installed = _installed
        if not self.active or installed is None:
            return True
        return installed.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        global _installed, _enabled
        if not self.active:
            return
        self.active = False
        with _lock:
            installed = _installed
            if installed is None:
                return
            installed.users -= 1
            if installed.users > 0:
                installed.provider.force_flush()
                return
            _installed, _enabled = None, False
        installed.provider.shutdown()  # flushes every processor, closes the exporters


def configure(service: str, modes: str | Sequence[str], servers: str | None = None, topic: str | None = None,
              *, exporter: Any = None) -> Tracing:
    """Install tracing for this process as ``service`` (``trajbus-gateway``, ...), unless installed already
    (then the first configuration stands and this is one more user of it). ``modes``: ``off``, ``kafka``,
    ``otlp`` (text or words); ``exporter``: a span exporter fed synchronously (tests' in-memory one)."""
    global _installed, _enabled
    words = parse_modes(modes if isinstance(modes, str) else ",".join(modes) or OFF)
    if words == OFF and exporter is None:
        return Tracing(False)
    with _lock:
        if _installed is not None:
            _installed.users += 1
            return Tracing(True)
        provider = _provider(service, words, servers, topic, exporter)
        _installed = _Installed(provider, provider.get_tracer("trajbus"), 1)
        _enabled = True
    log.info("tracing on service=%s exporters=%s%s", service, words,
             f" topic={topic}" if KAFKA in words.split(",") else "")
    return Tracing(True)


def _provider(service: str, words: str, servers: str | None, topic: str | None, exporter: Any) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=_ids())
    for mode in words.split(","):
        if mode == KAFKA:
            if not servers or not topic:
                raise ValueError("tracing: kafka needs the bootstrap servers and the traces topic")
            from trajbus.infra.trace_export import KafkaSpanExporter

            provider.add_span_processor(BatchSpanProcessor(KafkaSpanExporter.connect(servers, topic)))
        elif mode == OTLP:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _ids() -> Any:
    """Random ids, except where ``export_trajectory_root`` forces the trajectory's own."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class TrajectoryIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            forced = _forced_ids.get()
            return forced[0] if forced else super().generate_trace_id()

        def generate_span_id(self) -> int:
            forced = _forced_ids.get()
            return forced[1] if forced else super().generate_span_id()

    return TrajectoryIds()


def export_trajectory_root(trajectory_uid: str, start_ns: int, attributes: Mapping[str, Any]) -> None:
    """The trajectory's root span (``trajbus.trajectory``, zero length, its derived ids), so the spans that
    name it as parent form one connected trace in a tracing backend."""
    token = _forced_ids.set(trajectory_ids(trajectory_uid))
    try:
        span = tracer().start_span(TRAJECTORY, context=Context(), start_time=start_ns,
                                   attributes={TRAJECTORY_UID: trajectory_uid, **attributes})
    finally:
        _forced_ids.reset(token)
    span.end(end_time=start_ns)


def traceparent(context: Context | None = None) -> str | None:
    """The W3C ``traceparent`` of ``context`` (None: the current one); None when it holds no valid span."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context)
    return carrier.get(TRACEPARENT)


def context_from_traceparent(value: str | bytes | None) -> Context | None:
    """The context a ``traceparent`` names; None when absent or malformed."""
    if not value:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("ascii")
        except UnicodeDecodeError:
            return None
    context = _propagator.extract({TRACEPARENT: value})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def inject_headers(headers: list[tuple[str, bytes]], context: Context | None = None) -> list[tuple[str, bytes]]:
    """``headers`` with the ``traceparent`` of ``context`` (None: the current one) added, when it has one."""
    value = traceparent(context)
    if value is not None:
        headers.append((TRACEPARENT, value.encode("ascii")))
    return headers


def header_value(headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | None, name: str) -> Any:
    """One header of a Kafka record, whatever the client's shape (confluent's list, Faust's, a dict)."""
    if not headers:
        return None
    if isinstance(headers, Mapping):
        return headers.get(name)
    for key, value in headers:
        if key == name:
            return value
    return None


def context_from_headers(headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> Context | None:
    """The context a record's ``traceparent`` header names; None without a valid one."""
    return context_from_traceparent(header_value(headers, TRACEPARENT))


def parent_context(trajectory_uid: str, context: Context | None) -> Context:
    """``context`` when the record carried one, else the trajectory's root."""
    return context if context is not None else trajectory_context(trajectory_uid)
