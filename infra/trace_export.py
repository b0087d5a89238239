"""Finished OpenTelemetry spans as Kafka records, so a trajectory's timeline is read from the topics alone.

A span is one record of ``{prefix}.traces``: its value is ``encode_span``'s JSON (orjson), its key the
span's ``trajbus.trajectory_uid`` attribute, else its trace id in hex (a span of no one trajectory, e.g.
a batch's conversion), its timestamp the span's end. ``decode_span`` reads one back as a ``SpanRecord``;
``trajbus trace`` (``consumers.trace_timeline``) is the reader.

``KafkaSpanExporter`` is what ``infra.tracing`` hands a ``BatchSpanProcessor`` under ``--tracing kafka``:
``export`` queues records on an acknowledged producer without waiting for them (the processor's worker
thread calls it, off the request path); ``force_flush`` and ``shutdown`` wait for the acknowledgements.
A span the broker never acknowledged is counted and logged, never retried by hand: the producer's own
retries (``client_roles.DELIVERY_TIMEOUT_MS``) already cover a leader election.

The value, one JSON object::

    {"v": 1, "trace_id": "<32 hex>", "span_id": "<16 hex>", "parent_id": "<16 hex>" | null,
     "name": str, "service": str, "kind": "INTERNAL" | "SERVER" | ..., "start_ns": int, "end_ns": int,
     "attributes": {str: value}, "status": {"code": "UNSET" | "OK" | "ERROR", "description": str | null},
     "links": [{"trace_id": ..., "span_id": ..., "attributes": {...}}],
     "events": [{"name": str, "time_ns": int, "attributes": {...}}]}
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import orjson
from confluent_kafka import KafkaError, Message, Producer
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from trajbus.infra.clients import acked_producer
from trajbus.infra.span_names import TRAJECTORY_UID  # the attribute that names a span's trajectory: the key

__all__ = ["FORMAT_VERSION", "KafkaSpanExporter", "SpanDecodeError", "SpanLink", "SpanRecord", "decode_span",
           "encode_span", "span_key"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_UNKNOWN_SERVICE = "unknown_service"


class SpanDecodeError(ValueError):
    """A traces record that is not a span of this format; the message says what is wrong."""


@dataclass(frozen=True)
class SpanLink:
    """A link to another span (a batch's conversion links the fetches of its other trajectories)."""

    trace_id: str
    span_id: str
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SpanRecord:
    """One finished span as read back from the traces topic; ids are lower-case hex."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    status: str = "UNSET"
    status_description: str | None = None
    links: tuple[SpanLink, ...] = ()
    events: tuple[Mapping[str, Any], ...] = ()

    @property
    def trajectory_uid(self) -> str | None:
        value = self.attributes.get(TRAJECTORY_UID)
        return value if isinstance(value, str) else None

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def _attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """OTel attribute values are scalars or sequences of them; JSON keeps both (a tuple as a list)."""
    return {str(k): list(v) if isinstance(v, (tuple, list)) else v for k, v in (attributes or {}).items()}


def encode_span(span: ReadableSpan) -> bytes:
    """The record value of a finished span (the module docstring's format)."""
    context = span.context
    if context is None:
        raise ValueError("span: has no context (not a span of an SDK tracer)")
    service = span.resource.attributes.get("service.name", _UNKNOWN_SERVICE) if span.resource else _UNKNOWN_SERVICE
    return orjson.dumps({
        "v": FORMAT_VERSION,
        "trace_id": _hex(context.trace_id, 32),
        "span_id": _hex(context.span_id, 16),
        "parent_id": _hex(span.parent.span_id, 16) if span.parent is not None else None,
        "name": span.name,
        "service": str(service),
        "kind": span.kind.name,
        "start_ns": span.start_time or 0,
        "end_ns": span.end_time or span.start_time or 0,
        "attributes": _attributes(span.attributes),
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "links": [{"trace_id": _hex(link.context.trace_id, 32), "span_id": _hex(link.context.span_id, 16),
                   "attributes": _attributes(link.attributes)} for link in span.links],
        "events": [{"name": event.name, "time_ns": event.timestamp, "attributes": _attributes(event.attributes)}
                   for event in span.events],
    })


def span_key(span: ReadableSpan) -> bytes:
    """The record key: the span's trajectory, else its trace, so a trajectory's spans share a partition."""
    uid = (span.attributes or {}).get(TRAJECTORY_UID)
    if isinstance(uid, str) and uid:
        return uid.encode()
    return _hex(span.context.trace_id, 32).encode() if span.context is not None else b""


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise SpanDecodeError(f"{name}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def decode_span(value: bytes | None) -> SpanRecord:
    """A traces record's value as a ``SpanRecord``; ``SpanDecodeError`` names what is wrong."""
    try:
        data = orjson.loads(value or b"")
    except orjson.JSONDecodeError as exc:
        raise SpanDecodeError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SpanDecodeError(f"expected a JSON object, got {type(data).__name__}")
    if data.get("v") != FORMAT_VERSION:
        raise SpanDecodeError(f"format version {data.get('v')!r} is not {FORMAT_VERSION}")
    parent = data.get("parent_id")
    if parent is not None and not isinstance(parent, str):
        raise SpanDecodeError(f"parent_id: expected a hex string or null, got {parent!r}")
    status = data.get("status") or {}
    links = tuple(SpanLink(_field(link, "trace_id", str), _field(link, "span_id", str), link.get("attributes") or {})
                  for link in data.get("links") or () if isinstance(link, dict))
    return SpanRecord(
        trace_id=_field(data, "trace_id", str), span_id=_field(data, "span_id", str), parent_id=parent,
        name=_field(data, "name", str), service=str(data.get("service") or _UNKNOWN_SERVICE),
        kind=str(data.get("kind") or "INTERNAL"), start_ns=_field(data, "start_ns", int),
        end_ns=_field(data, "end_ns", int), attributes=_field(data, "attributes", dict),
        status=str(status.get("code") or "UNSET"), status_description=status.get("description"),
        links=links, events=tuple(e for e in data.get("events") or () if isinstance(e, dict)))


class KafkaSpanExporter(SpanExporter):
    """Spans to one Kafka topic through an acknowledged producer this exporter owns (``connect``)."""

    def __init__(self, producer: Producer, topic: str, flush_timeout_s: float = 10.0) -> None:
        self.producer, self.topic, self.flush_timeout_s = producer, topic, flush_timeout_s
        self.failed = 0
        """Spans the broker did not acknowledge, or that found the producer's queue full."""
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, servers: str, topic: str) -> "KafkaSpanExporter":
        """An exporter with its own producer: batched (``linger.ms``) and compressed, spans being small
        and many; the producer connects lazily, so a broker still starting costs no wait here."""
        producer = acked_producer(servers, {"linger.ms": 50, "compression.type": "lz4", "logger": log})
        return cls(producer, topic)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Queue one record per span and return: acknowledgements are served by later ``poll`` calls."""
        if self._closed:
            return SpanExportResult.FAILURE
        for index, span in enumerate(spans):
            try:
                self.producer.produce(self.topic, key=span_key(span), value=encode_span(span),
                                      timestamp=(span.end_time or span.start_time or 0) // 1_000_000,
                                      on_delivery=self._delivered)
            except BufferError:  # the queue is full: the broker is away or far behind; drop, never block
                self._count_failure(len(spans) - index, "the producer's queue is full")
                self.producer.poll(0)
                return SpanExportResult.FAILURE
        self.producer.poll(0)
        return SpanExportResult.SUCCESS

    def _delivered(self, error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            self._count_failure(1, error.str())

    def _count_failure(self, count: int, why: str) -> None:
        first = self.failed == 0
        self.failed += count
        if first or self.failed % 1000 < count:  # the first loss, then one line per thousand spans lost
            log.warning("tracing: %d span(s) not written to %s (%d so far): %s", count, self.topic, self.failed, why)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """True once every queued span is acknowledged (or failed) within the timeout."""
        if self._closed:
            return True
        return self.producer.flush(timeout_millis / 1000) == 0

    def shutdown(self) -> None:
        """Wait up to ``flush_timeout_s`` for the queued spans, then close the producer (once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        left = self.producer.flush(self.flush_timeout_s)
        if left:
            log.warning("tracing: %d span(s) still unacknowledged at shutdown, lost", left)
        self.producer.close()
