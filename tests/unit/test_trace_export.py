"""Spans as traces records (infra.trace_export) and a trajectory's timeline from them (consumers.trace_timeline)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, Status, StatusCode

from trajbus.consumers.trace_timeline import COLUMNS, Timeline, cells, details, header, select_spans, span_rows
from trajbus.infra.trace_export import (KafkaSpanExporter, SpanDecodeError, SpanRecord, decode_span, encode_span,
                                        span_key)
from trajbus.pipelines.tables import render
from trajbus.streams.wire.topics import traces_topic

MS = 1_000_000


def finished_spans(service: str = "trajbus-gateway") -> tuple[InMemorySpanExporter, trace.Tracer]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory, provider.get_tracer("tests")


def test_a_span_survives_the_round_trip_with_ids_parent_attributes_status_links_and_events():
    memory, tracer = finished_spans()
    with tracer.start_as_current_span("trajbus.call", start_time=1_000 * MS,
                                      attributes={"trajbus.trajectory_uid": "t-1", "trajbus.step_index": 2}) as call:
        other = call.get_span_context()
        child = tracer.start_span("trajbus.engine", start_time=1_001 * MS, links=[Link(other, {"why": "batch"})],
                                  attributes={"trajbus.tokens": 12, "trajbus.backend": "engine-a",
                                              "sizes": (1, 2), "ok": True, "ratio": 0.5})
        child.add_event("retry", {"attempt": 1}, timestamp=1_002 * MS)
        child.set_status(Status(StatusCode.ERROR, "engine 503"))
        child.end(end_time=1_040 * MS)
        call.end(end_time=1_050 * MS)
    engine, call_span = memory.get_finished_spans()

    record = decode_span(encode_span(engine))
    assert record.trace_id == format(engine.context.trace_id, "032x") and len(record.trace_id) == 32
    assert record.span_id == format(engine.context.span_id, "016x") and len(record.span_id) == 16
    assert record.parent_id == format(call_span.context.span_id, "016x")
    assert (record.name, record.service, record.kind) == ("trajbus.engine", "trajbus-gateway", "INTERNAL")
    assert (record.start_ns, record.end_ns, record.duration_ns) == (1_001 * MS, 1_040 * MS, 39 * MS)
    assert record.attributes == {"trajbus.tokens": 12, "trajbus.backend": "engine-a", "sizes": [1, 2], "ok": True,
                                 "ratio": 0.5}
    assert (record.status, record.status_description) == ("ERROR", "engine 503")
    [link] = record.links
    assert (link.trace_id, link.span_id, dict(link.attributes)) == (record.trace_id, record.parent_id, {"why": "batch"})
    assert record.events == ({"name": "retry", "time_ns": 1_002 * MS, "attributes": {"attempt": 1}},)
    assert record.trajectory_uid is None

    root = decode_span(encode_span(call_span))
    assert root.parent_id is None and root.trajectory_uid == "t-1" and root.links == () and root.status == "UNSET"
    assert span_key(call_span) == b"t-1"  # the trajectory's spans share a key, so a partition
    assert span_key(engine) == record.trace_id.encode()  # a span of no trajectory: its trace


@pytest.mark.parametrize("value, words", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"v": 99}', "format version 99"),
    (orjson.dumps({"v": 1, "trace_id": "a" * 32, "span_id": "b" * 16, "name": "x", "start_ns": "soon",
                   "end_ns": 2, "attributes": {}}), "start_ns: expected int"),
    (orjson.dumps({"v": 1, "trace_id": "a" * 32, "span_id": "b" * 16, "name": "x", "start_ns": True,
                   "end_ns": 2, "attributes": {}}), "start_ns: expected int"),
    (None, "not JSON"),
])
def test_a_record_that_is_no_span_is_refused_with_the_reason(value, words):
    with pytest.raises(SpanDecodeError, match=words):
        decode_span(value)


class FakeProducer:
    """confluent_kafka.Producer's calls the exporter makes, with a queue of ``room`` records."""

    def __init__(self, room: int = 100, unflushed: int = 0) -> None:
        self.records: list[dict[str, Any]] = []
        self.room, self.unflushed = room, unflushed
        self.polls = self.closes = 0
        self.flushes: list[float] = []

    def produce(self, topic: str, **record: Any) -> None:
        if len(self.records) >= self.room:
            raise BufferError("Local: Queue full")
        self.records.append({"topic": topic, **record})

    def poll(self, timeout: float) -> int:
        self.polls += 1
        return 0

    def flush(self, timeout: float) -> int:
        self.flushes.append(timeout)
        return self.unflushed

    def close(self) -> None:
        self.closes += 1


class FakeError:
    def str(self) -> str:
        return "Broker: Not enough in-sync replicas"


def test_the_exporter_queues_one_keyed_record_per_span_without_waiting_and_flushes_at_shutdown():
    memory, tracer = finished_spans("trajbus-worker")
    for index in range(3):
        tracer.start_span("trajbus.apply", start_time=index * MS,
                          attributes={"trajbus.trajectory_uid": f"t-{index}"}).end(end_time=index * MS + 500)
    producer = FakeProducer()
    exporter = KafkaSpanExporter(producer, "p.traces", flush_timeout_s=3.0)

    assert exporter.export(memory.get_finished_spans()) is SpanExportResult.SUCCESS
    assert [r["key"] for r in producer.records] == [b"t-0", b"t-1", b"t-2"]
    assert {r["topic"] for r in producer.records} == {"p.traces"}
    assert [r["timestamp"] for r in producer.records] == [0, 1, 2]  # the span's end, in ms
    assert decode_span(producer.records[1]["value"]).service == "trajbus-worker"
    assert producer.polls == 1 and producer.flushes == []  # served, not awaited

    producer.records[0]["on_delivery"](FakeError(), None)
    assert exporter.failed == 1
    assert exporter.force_flush(2_000) and producer.flushes == [2.0]

    exporter.shutdown()
    exporter.shutdown()
    assert producer.flushes == [2.0, 3.0] and producer.closes == 1
    assert exporter.export(memory.get_finished_spans()) is SpanExportResult.FAILURE
    assert exporter.force_flush() and producer.flushes == [2.0, 3.0]


def test_a_full_queue_drops_the_rest_of_the_batch_and_never_blocks(caplog):
    memory, tracer = finished_spans()
    for index in range(5):
        tracer.start_span("trajbus.call", start_time=index * MS).end(end_time=index * MS + 1)
    producer = FakeProducer(room=2, unflushed=1)
    exporter = KafkaSpanExporter(producer, "p.traces", flush_timeout_s=0.5)

    assert exporter.export(memory.get_finished_spans()) is SpanExportResult.FAILURE
    assert len(producer.records) == 2 and exporter.failed == 3
    assert "3 span(s) not written to p.traces" in caplog.text and "queue is full" in caplog.text
    exporter.shutdown()
    assert "1 span(s) still unacknowledged at shutdown" in caplog.text and producer.closes == 1


def span(name: str, start_ms: float, end_ms: float, uid: str | None = "t-1", trace_id: str = "a" * 32,
         span_id: str = "1" * 16, parent_id: str | None = None, service: str = "trajbus-gateway",
         links: tuple = (), status: str = "UNSET", **attributes: Any) -> SpanRecord:
    attributes = {f"trajbus.{k}": v for k, v in attributes.items()}
    if uid is not None:
        attributes["trajbus.trajectory_uid"] = uid
    return SpanRecord(trace_id, span_id, parent_id, name, service, "INTERNAL", int(start_ms * MS), int(end_ms * MS),
                      attributes, status, links=links)


def record(s: SpanRecord) -> tuple[bytes, bytes]:
    """As the exporter keys it: the trajectory, else the trace."""
    value = orjson.dumps({"v": 1, "trace_id": s.trace_id, "span_id": s.span_id, "parent_id": s.parent_id,
                          "name": s.name, "service": s.service, "kind": s.kind, "start_ns": s.start_ns,
                          "end_ns": s.end_ns, "attributes": dict(s.attributes), "status": {"code": s.status},
                          "links": [{"trace_id": link.trace_id, "span_id": link.span_id} for link in s.links]})
    return (s.trajectory_uid or s.trace_id).encode(), value


def test_a_trajectorys_spans_are_its_own_its_traces_unnamed_spans_and_spans_that_link_into_them():
    from trajbus.infra.trace_export import SpanLink

    mine = span("trajbus.call", 0, 10, span_id="c" * 16)
    agent_trace = span("trajbus.call", 20, 30, trace_id="e" * 32, span_id="d" * 16)  # the agent's own trace
    unnamed = span("trajbus.engine", 1, 9, uid=None, span_id="f" * 16, parent_id="c" * 16)
    convert = span("trajbus.convert", 50, 60, uid=None, trace_id="b" * 32, service="trajbus-trainer",
                   links=(SpanLink("e" * 32, "9" * 16),))
    neighbour = span("trajbus.call", 0, 5, uid="t-2", trace_id="e" * 32)  # shares the agent's trace
    strangers = span("trajbus.convert", 0, 5, uid=None, trace_id="7" * 32)
    records = [record(s) for s in (mine, neighbour, unnamed, strangers, agent_trace, convert)]
    records += [(b"t-1", b"garbage"), (None, b"{}"), (b"0" * 32, b"[]")]

    spans, bad = select_spans("t-1", records)
    assert sorted(s.span_id for s in spans) == sorted(s.span_id for s in (mine, agent_trace, unnamed, convert))
    assert bad == 2  # keyed by the uid or by a trace id, yet no span; a record of no key is not even read


def test_rows_are_in_start_order_timed_from_the_first_with_gaps_since_everything_above_ended():
    spans = [
        span("trajbus.apply", 62, 63, service="trajbus-worker", partition=3, offset=17, step_index=0),
        span("trajbus.publish", 41, 49, step_index=0, parent_id="c" * 16),
        span("trajbus.call", 10, 50, span_id="c" * 16),
        span("trajbus.trajectory", 10, 10),
        span("trajbus.engine", 11, 40, backend="http://engine:8000", tokens=12, parent_id="c" * 16),
        span("trajbus.emit", 63, 63.5, service="trajbus-worker", outcome="emitted", status="ERROR"),
    ]
    rows = span_rows(spans)

    assert [r.name for r in rows] == ["trajbus.call", "trajbus.trajectory", "trajbus.engine", "trajbus.publish",
                                      "trajbus.apply", "trajbus.emit"]  # a parent before what starts with it
    assert [r.start_ms for r in rows] == [0.0, 0.0, 1.0, 31.0, 52.0, 53.0]
    assert [r.duration_ms for r in rows] == [40.0, 0.0, 29.0, 8.0, 1.0, 0.5]
    assert [r.gap_ms for r in rows] == [None, None, None, None, 12.0, 0.0]  # none while the call still runs
    assert details(rows[4]) == "step=0 at=3@17"
    assert details(rows[2]) == "backend=http://engine:8000 tokens=12"
    assert details(rows[5]) == "outcome=emitted status=ERROR"
    assert rows[3].parent_id == "c" * 16 and rows[4].service == "trajbus-worker"


def test_of_spans_that_start_together_a_parent_comes_before_its_children_however_short():
    root = span("trajbus.trajectory", 0, 0, span_id="0" * 16)
    call = span("trajbus.call", 0, 40, span_id="c" * 16, parent_id="0" * 16)
    engine = span("trajbus.engine", 0, 30, span_id="e" * 16, parent_id="c" * 16)
    looping = span("trajbus.apply", 0, 50, span_id="a" * 16, parent_id="b" * 16)  # a cycle ends, never hangs
    twin = span("trajbus.apply", 0, 50, span_id="b" * 16, parent_id="a" * 16)
    rows = span_rows([engine, call, root])
    assert [r.name for r in rows] == ["trajbus.trajectory", "trajbus.call", "trajbus.engine"]
    assert [r.gap_ms for r in rows] == [None, 0.0, None]  # the call begins as the zero-length marker ends
    assert sorted(r.span_id for r in span_rows([looping, twin])) == ["a" * 16, "b" * 16]


def test_the_timeline_reads_as_a_table_under_a_header_and_as_json():
    rows = span_rows([span("trajbus.call", 1000, 1040.25, step_index=1),
                      span("trajbus.apply", 1045, 1046, service="trajbus-worker", partition=0, offset=5)])
    timeline = Timeline("t-1", rows, ["a" * 32], 46.0, "spans", [traces_topic("p")])

    assert header(timeline) == f"trajectory t-1  trace {'a' * 32}  wall 46.0 ms  2 spans"
    assert cells(rows) == [["0.0", "40.2", "", "trajbus-gateway", "trajbus.call", "step=1"],
                           ["45.0", "1.0", "4.8", "trajbus-worker", "trajbus.apply", "at=0@5"]]
    lines = render(COLUMNS, cells(rows)).splitlines()
    assert lines[0].split() == ["+ms", "dur", "ms", "gap", "ms", "service", "span", "attributes"]
    assert lines[-1].split() == ["45.0", "1.0", "4.8", "trajbus-worker", "trajbus.apply", "at=0@5"]

    as_json = json.loads(json.dumps(timeline.as_json()))
    assert as_json["spans"] == 2 and as_json["source"] == "spans" and as_json["trace_ids"] == ["a" * 32]
    assert as_json["rows"][1]["gap_ms"] == 4.75 and as_json["rows"][1]["attributes"]["trajbus.offset"] == 5

    off = Timeline("t-1", rows, [], 46.0, "records", ["p.steps.train", "p.groups.train"])
    assert header(off) == ("trajectory t-1  trace -  wall 46.0 ms  0 spans  (tracing was off: the timeline of its "
                           "records in p.steps.train, p.groups.train)")
