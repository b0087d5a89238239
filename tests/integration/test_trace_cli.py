"""`trajbus trace UID`: a trajectory's timeline read back from a real broker, from its spans (written by
KafkaSpanExporter) or, with tracing off, from its records on the steps and groups topics."""

from __future__ import annotations

import json
import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from trajbus.infra.clients import acked_producer
from trajbus.infra.topics import ensure_topics
from trajbus.infra.trace_export import KafkaSpanExporter
from trajbus.streams.client.chunks import produce_group
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.records import ReadyGroup, Step
from trajbus.streams.wire.topics import chunks_topic, groups_topic, steps_topic, traces_topic
from tests.helpers import trajbus

MS = 1_000_000


class Process:
    """One traced component (its own provider and exporter), as the gateway, a worker, a trainer are."""

    def __init__(self, service: str, servers: str, prefix: str) -> None:
        self.exporter = KafkaSpanExporter.connect(servers, traces_topic(prefix))
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("tests")

    def span(self, name: str, start: float, end: float, parent: trace.Span | None = None, **attributes) -> trace.Span:
        """A finished span ``start``..``end`` ms after ``BASE``; ``parent``: its parent (a root without)."""
        context = trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(name, context=context, start_time=BASE + int(start * MS),
                                      attributes={f"trajbus.{k}": v for k, v in attributes.items()})
        span.end(end_time=BASE + int(end * MS))
        return span

    def close(self) -> None:
        self.provider.shutdown()  # the exporter's shutdown: every span acknowledged, the producer closed
        assert self.exporter.failed == 0


BASE = (time.time_ns() // MS - 60_000) * MS


def write_trajectory_spans(servers: str, prefix: str, uid: str) -> None:
    """Two turns through the gateway, their steps applied and the group emitted by a worker, the trainer's
    fetch and conversion; some spans name no trajectory (keyed by their trace). And a neighbour's call."""
    gateway, worker, trainer = (Process(f"trajbus-{s}", servers, prefix) for s in ("gateway", "worker", "trainer"))
    try:
        root = gateway.span("trajbus.trajectory", 0, 0, trajectory_uid=uid)
        applied = None
        for turn, (start, offset) in enumerate([(0, 5), (60, 6)]):
            call = gateway.span("trajbus.call", start, start + 40, root, trajectory_uid=uid, step_index=turn)
            gateway.span("trajbus.engine", start + 1, start + 30, call, trajectory_uid=uid, backend="engine-a",
                         tokens=7 + 2 * turn)
            publish = gateway.span("trajbus.publish", start + 31, start + 39, call, step_index=turn, partition=2,
                                   offset=offset)
            applied = worker.span("trajbus.apply", start + 45, start + 46, publish, trajectory_uid=uid,
                                  step_index=turn, partition=2, offset=offset)
        emit = worker.span("trajbus.emit", 106, 107, applied, trajectory_uid=uid, outcome="emitted", partition=0,
                           offset=0)
        fetch = trainer.span("trajbus.fetch", 130, 131, emit, trajectory_uid=uid, partition=0, offset=0)
        trainer.span("trajbus.convert", 131, 140, fetch)
        gateway.span("trajbus.call", 5, 20, trajectory_uid=f"{uid}-neighbour", step_index=0)
    finally:
        for process in (gateway, worker, trainer):
            process.close()


def test_trace_prints_a_trajectorys_spans_in_start_order_with_durations_and_gaps(bootstrap_servers, prefix):
    ensure_topics(bootstrap_servers, [TopicSettings(prefix=prefix).spec(traces_topic(prefix), 2, {})])
    uid = "p0/t0"
    write_trajectory_spans(bootstrap_servers, prefix, uid)
    where = ("--prefix", prefix, "--bootstrap-servers", bootstrap_servers)

    result = trajbus("trace", uid, *where, "--json")
    assert result.returncode == 0, result.stderr
    timeline = json.loads(result.stdout)
    rows = timeline["rows"]
    assert (timeline["source"], timeline["spans"], timeline["wall_ms"]) == ("spans", 12, 140.0)
    assert len(timeline["trace_ids"]) == 1 and {r["trace_id"] for r in rows} == set(timeline["trace_ids"])
    assert [(r["name"], r["start_ms"], r["duration_ms"], r["gap_ms"]) for r in rows] == [
        ("trajbus.trajectory", 0.0, 0.0, None), ("trajbus.call", 0.0, 40.0, 0.0),
        ("trajbus.engine", 1.0, 29.0, None), ("trajbus.publish", 31.0, 8.0, None),
        ("trajbus.apply", 45.0, 1.0, 5.0),
        ("trajbus.call", 60.0, 40.0, 14.0), ("trajbus.engine", 61.0, 29.0, None),
        ("trajbus.publish", 91.0, 8.0, None), ("trajbus.apply", 105.0, 1.0, 5.0),
        ("trajbus.emit", 106.0, 1.0, 0.0), ("trajbus.fetch", 130.0, 1.0, 23.0), ("trajbus.convert", 131.0, 9.0, 0.0)]
    assert [r["service"] for r in rows] == ["trajbus-gateway"] * 4 + ["trajbus-worker"] + ["trajbus-gateway"] * 3 + \
        ["trajbus-worker"] * 2 + ["trajbus-trainer"] * 2
    by_id = {r["span_id"]: r for r in rows}
    assert by_id[rows[4]["parent_id"]]["name"] == "trajbus.publish"  # the worker's apply: a child of the publish
    assert by_id[rows[11]["parent_id"]]["name"] == "trajbus.fetch"

    text = trajbus("trace", uid, *where)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"trajectory {uid}  trace {timeline['trace_ids'][0]}  wall 140.0 ms  12 spans"
    table = [line.split() for line in lines[1:]]
    assert table[0] == ["+ms", "dur", "ms", "gap", "ms", "service", "span", "attributes"]
    assert ["61.0", "29.0", "trajbus-gateway", "trajbus.engine", "backend=engine-a", "tokens=9"] in table
    assert ["45.0", "1.0", "5.0", "trajbus-worker", "trajbus.apply", "step=0", "at=2@5"] in table
    assert ["106.0", "1.0", "0.0", "trajbus-worker", "trajbus.emit", "at=0@0", "outcome=emitted"] in table

    missing = trajbus("trace", "p0/nobody", *where)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip() == (f"trajbus trace: no span and no record of trajectory 'p0/nobody' under prefix "
                                      f"{prefix!r} (read {prefix}.traces and {prefix}.steps.* to their ends)")
    bad = trajbus("trace", uid, "--prefix", "no/slashes", "--bootstrap-servers", bootstrap_servers)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a valid topic prefix" in bad.stderr


def test_with_tracing_off_trace_prints_the_trajectorys_records_on_the_steps_and_groups_topics(bootstrap_servers,
                                                                                             prefix):
    start = time.time() - 30
    steps = [Step(prompt_ids=[1, 2, 3, 4, 5, 6][:3 + 3 * i], response_ids=[4, 5], trajectory_uid="q7/t0",
                  prompt_uid="q7", step_index=i, is_last=i == 1, created_at=start + 0.25 * i)
             for i in range(2)]  # the second turn's prompt extends the first's: written as a delta
    other = Step(prompt_ids=[9], response_ids=[8], trajectory_uid="q8/t0", prompt_uid="q8", created_at=start)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.submit_steps(steps + [other], channel="train")
        producer.complete_trajectory("q7/t0", "q7", reward=1.0, channel="train")
    groups = acked_producer(bootstrap_servers)
    try:
        errors: list = []
        for group in (ReadyGroup("q8", "train", [other], 1), ReadyGroup("q7", "train", steps, 1)):
            produce_group(groups, groups_topic("train", prefix), chunks_topic("train", prefix), group, [],
                          TopicSettings().max_message_bytes, lambda error, _m: errors.append(error) if error else None)
        assert groups.flush(30) == 0 and not errors
    finally:
        groups.close()

    result = trajbus("trace", "q7/t0", "--prefix", prefix, "--bootstrap-servers", bootstrap_servers, "--json")
    assert result.returncode == 0, result.stderr
    timeline = json.loads(result.stdout)
    assert (timeline["source"], timeline["spans"], timeline["trace_ids"]) == ("records", 0, [])
    assert timeline["topics"] == [steps_topic("train", prefix), groups_topic("train", prefix)]
    rows = timeline["rows"]
    assert [(r["name"], r["service"]) for r in rows] == [
        ("step", steps_topic("train", prefix)), ("step", steps_topic("train", prefix)),
        ("end", steps_topic("train", prefix)), ("group", groups_topic("train", prefix))]
    assert [r["start_ms"] for r in rows[:2]] == [0.0, 250.0] and rows[1]["gap_ms"] == 250.0
    assert all(r["duration_ms"] is None and r["span_id"] is None for r in rows)
    assert [r["attributes"].get("trajbus.step_index") for r in rows] == [0, 1, None, None]
    assert rows[0]["attributes"]["trajbus.partition"] == rows[2]["attributes"]["trajbus.partition"]
    assert rows[0]["attributes"]["trajbus.offset"] < rows[1]["attributes"]["trajbus.offset"] < \
        rows[2]["attributes"]["trajbus.offset"]
    assert (rows[3]["attributes"]["trajbus.offset"], rows[3]["attributes"]["trajbus.outcome"]) == (1, "complete")

    text = trajbus("trace", "q7/t0", "--prefix", prefix, "--bootstrap-servers", bootstrap_servers)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0] == (
        f"trajectory q7/t0  trace -  wall {timeline['wall_ms']:.1f} ms  0 spans  (tracing was off: the timeline of "
        f"its records in {steps_topic('train', prefix)}, {groups_topic('train', prefix)})")
    assert "step=1 at=" in text.stdout and "outcome=complete" in text.stdout
