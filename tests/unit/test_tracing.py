"""Tracing's rules without a broker (``infra.tracing``, spans to an in-memory exporter): a trajectory's trace
is derived from its uid, its root is exported with those ids, W3C headers round-trip, off installs nothing
and adds no header, and the gateway's, worker's and trainer's spans have the parents the design names."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import orjson
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from trajbus.consumers.fetch_traces import FetchTraces
from trajbus.gateway.chat.call_spans import call_spans
from trajbus.infra import tracing
from trajbus.streams.client.delivery import Poller
from trajbus.streams.client.sender import RecordSender
from trajbus.streams.wire.headers import GROUP_TRACEPARENTS
from trajbus.streams.wire.prefix import PrefixEncoder
from trajbus.streams.worker.direct_reads import SourceRecord
from trajbus.streams.worker.traces import StepTraces
from tests.unit.test_declared import subcommand
from tests.unit.test_producer import FakeClient
from tests.unit.worker_fakes import CHANNEL, new_worker, step

AGENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    handle = tracing.configure("trajbus-test", "off", exporter=exporter)
    yield exporter
    handle.shutdown()
    assert not tracing.enabled()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    found: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


def parent_id(span) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_a_trajectory_s_trace_and_root_ids_are_derived_from_its_uid_alone():
    digest = hashlib.sha256(b"traj-1").digest()
    assert tracing.trajectory_ids("traj-1") == (int.from_bytes(digest[:16], "big"),
                                                int.from_bytes(digest[16:24], "big"))
    assert tracing.trajectory_ids("traj-1") != tracing.trajectory_ids("traj-2")
    root = trace.get_current_span(tracing.trajectory_context("traj-1")).get_span_context()
    assert (root.trace_id, root.span_id) == tracing.trajectory_ids("traj-1")
    assert root.is_remote and root.trace_flags.sampled


def test_the_root_span_is_exported_with_the_trajectory_s_own_ids_and_children_join_it(spans):
    tracing.export_trajectory_root("traj-1", 1_000, {tracing.CHANNEL: "train"})
    child = tracing.tracer().start_span("child", context=tracing.trajectory_context("traj-1"))
    child.end()
    found = by_name(spans)
    [root] = found[tracing.TRAJECTORY]
    trace_id, span_id = tracing.trajectory_ids("traj-1")
    assert (root.context.trace_id, root.context.span_id, root.parent) == (trace_id, span_id, None)
    assert root.start_time == root.end_time == 1_000
    assert root.attributes[tracing.TRAJECTORY_UID] == "traj-1" and root.resource.attributes["service.name"] == \
        "trajbus-test"
    [child] = found["child"]
    assert (child.context.trace_id, parent_id(child)) == (trace_id, span_id)
    assert child.context.span_id != span_id, "only the root is given the derived span id"


def test_traceparent_headers_round_trip_whatever_the_client_s_shape(spans):
    with tracing.tracer().start_as_current_span("publish") as span:
        headers = tracing.inject_headers([("content-type", b"x")])
    ids = span.get_span_context()
    assert headers[0] == ("content-type", b"x") and headers[1][0] == tracing.TRACEPARENT
    for shape in (headers, dict(headers), [(k, v.decode()) for k, v in headers]):
        extracted = trace.get_current_span(tracing.context_from_headers(shape)).get_span_context()
        assert (extracted.trace_id, extracted.span_id) == (ids.trace_id, ids.span_id)
    assert tracing.inject_headers([]) == [], "no current span: no header"
    for bad in (None, [], [(tracing.TRACEPARENT, b"00-zz-yy-01")], {tracing.TRACEPARENT: b"\xff"}):
        assert tracing.context_from_headers(bad) is None



class ProducingClient(FakeClient):
    def __init__(self) -> None:
        super().__init__()
        self.produced: list = []

    def produce(self, topic, key, value, headers, on_delivery, timestamp) -> None:
        self.produced.append(dict(headers))
        with self.lock:
            self.reports.append(on_delivery)


def publish_one(index: int) -> dict:
    client = ProducingClient()
    poller = Poller(client)
    try:
        RecordSender(client, poller, PrefixEncoder()).publish("t", [step("p", "traj-1", index)], timeout=5)
    finally:
        poller.stop()
    return client.produced[0]


def test_off_installs_nothing_and_a_record_carries_no_trace_header():
    handle = tracing.configure("trajbus-test", "off")
    assert not tracing.enabled() and not handle.active
    assert isinstance(tracing.tracer(), trace.NoOpTracer)
    with tracing.tracer().start_as_current_span("nothing"):
        assert tracing.TRACEPARENT not in publish_one(0)
    handle.shutdown()


def test_on_a_record_carries_the_current_span_as_its_traceparent(spans):
    with tracing.tracer().start_as_current_span("trajbus.publish"):
        expected = tracing.traceparent()
        headers = publish_one(0)
    assert headers[tracing.TRACEPARENT] == expected.encode()
    assert tracing.TRACEPARENT not in publish_one(1), "outside a span: no header"


def test_tracing_is_configured_once_and_uninstalled_by_its_last_user(spans):
    second = tracing.configure("trajbus-other", "otlp")  # already configured: one more user of the first
    assert second.active and tracing.enabled()
    second.shutdown()
    assert tracing.enabled(), "the first user still traces"
    with tracing.tracer().start_as_current_span("still"):
        pass
    assert by_name(spans)["still"][0].resource.attributes["service.name"] == "trajbus-test"


@pytest.mark.parametrize("text, modes", [("off", "off"), ("", "off"), ("otlp, kafka", "kafka,otlp"),
                                         ("KAFKA", "kafka")])
def test_tracing_modes_are_normalized(text, modes):
    assert tracing.parse_modes(text) == modes


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_the_tracing_flag_is_declared_once_for_both_components(command, capsys):
    parser = subcommand(command)
    assert parser.parse_args(["--tracing", "otlp,kafka"]).tracing == "kafka,otlp"
    with pytest.raises(SystemExit):
        parser.parse_args(["--tracing", "jaeger"])
    assert "expected off or a comma-separated list of kafka, otlp, got 'jaeger'" in capsys.readouterr().err


def trajectory(uid: str = "traj-1", next_step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(trajectory_uid=uid, prompt_uid="p", channel="train", next_step=next_step)


def test_a_call_with_the_agent_s_traceparent_joins_the_agent_s_trace(spans):
    call = call_spans(trajectory(next_step=2), AGENT, 5_000)  # not the first call: no root exported
    call.engine_started()
    call.engine_ended("http://engine", 7)
    with call.publishing():
        header = tracing.traceparent()
    call.end()
    found = by_name(spans)
    [span], [engine], [publish] = found[tracing.CALL], found[tracing.ENGINE], found[tracing.PUBLISH]
    assert tracing.TRAJECTORY not in found
    assert format(span.context.trace_id, "032x") == AGENT.split("-")[1]
    assert format(parent_id(span), "016x") == AGENT.split("-")[2] and span.start_time == 5_000
    assert parent_id(engine) == parent_id(publish) == span.context.span_id
    assert engine.attributes[tracing.BACKEND] == "http://engine" and engine.attributes[tracing.TOKENS] == 7
    assert header.split("-")[1:3] == [f"{publish.context.trace_id:032x}", f"{publish.context.span_id:016x}"]


def test_a_trajectory_s_first_call_exports_its_root_and_is_its_child(spans):
    call = call_spans(trajectory(), None, 5_000)
    call.engine_started()
    call.end(RuntimeError("engine away"))
    found = by_name(spans)
    [root], [span], [engine] = found[tracing.TRAJECTORY], found[tracing.CALL], found[tracing.ENGINE]
    assert parent_id(span) == root.context.span_id and span.context.trace_id == root.context.trace_id
    assert not span.status.is_ok and not engine.status.is_ok, "a failed call's open spans end as errors"


def test_the_worker_parents_apply_to_the_record_and_emit_to_the_last_apply(spans):
    worker = new_worker()
    source = worker.source()
    with tracing.tracer().start_as_current_span("trajbus.publish") as publish:
        header = [(tracing.TRACEPARENT, tracing.traceparent().encode())]
    for i, uid in enumerate(["a", "b"]):
        record = source.append(step("p", uid))
        source.records[i] = SourceRecord(record.topic, record.partition, record.offset, None, record.value,
                                         header if uid == "a" else [])
        worker.deliver(source.records[i])
    found = by_name(spans)
    applied = {s.attributes[tracing.TRAJECTORY_UID]: s for s in found[tracing.APPLY]}
    assert parent_id(applied["a"]) == publish.get_span_context().span_id
    assert parent_id(applied["b"]) == tracing.trajectory_ids("b")[1], "no header: the trajectory's root"
    emits = {s.attributes[tracing.TRAJECTORY_UID]: s for s in found[tracing.EMIT]}
    for uid in ("a", "b"):
        assert parent_id(emits[uid]) == applied[uid].context.span_id
        assert emits[uid].attributes[tracing.OUTCOME] == "emitted" and emits[uid].attributes[tracing.OFFSET] == 0
    [group] = worker.sends.groups[CHANNEL]
    named = orjson.loads(group.header(GROUP_TRACEPARENTS))
    assert {uid: value.split("-")[1:3] for uid, value in named.items()} == \
        {uid: [f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}"] for uid, s in emits.items()}
    assert worker.assembler.traces._last == {}, "an ended group's trajectories are forgotten"


def test_the_worker_remembers_a_bounded_number_of_trajectories(spans):
    traces = StepTraces(remembered=2)
    for uid in ("a", "b", "c"):
        with traces.applying("train", 0, SimpleNamespace(headers=None, offset=0), step("p", uid)):
            pass
    assert list(traces._last) == ["b", "c"]
    traces.end_emit("train", "p", ["b"], "dropped (timeout)")
    assert list(traces._last) == ["c"]
    [emit] = by_name(spans)[tracing.EMIT]
    assert emit.attributes[tracing.OUTCOME] == "dropped (timeout)"


def test_the_trainer_fetches_from_the_group_header_and_converts_under_the_first_fetch(spans):
    emitted = {}
    for uid in ("a", "b"):
        with tracing.tracer().start_as_current_span(tracing.EMIT):
            emitted[uid] = tracing.traceparent()
    traces = FetchTraces("train")
    traces.fetched("p", ["a", "b"], 0, 7, [(GROUP_TRACEPARENTS, orjson.dumps(emitted))], 1_000)
    traces.fetched("q", ["c"], 0, 8, None, 2_000)
    with traces.converting([(0, 7), (0, 8)]):
        pass
    found = by_name(spans)
    fetches = {s.attributes[tracing.TRAJECTORY_UID]: s for s in found[tracing.FETCH]}
    for uid in ("a", "b"):
        assert format(parent_id(fetches[uid]), "016x") == emitted[uid].split("-")[2]
        assert fetches[uid].start_time == 1_000 and fetches[uid].attributes[tracing.OFFSET] == 7
    assert parent_id(fetches["c"]) == tracing.trajectory_ids("c")[1]
    [convert] = found[tracing.CONVERT]
    assert parent_id(convert) == fetches["a"].context.span_id
    assert [link.context.span_id for link in convert.links] == [fetches[u].context.span_id for u in ("b", "c")]
