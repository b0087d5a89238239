"""``trajbus trace``: one trajectory's timeline, from the topics alone (no tracing backend).

With tracing on (``--tracing kafka``), every process writes its finished spans to ``{prefix}.traces``
(``infra.trace_export``). This reads that topic up to its end offsets, keeps the trajectory's spans
(those whose ``trajbus.trajectory_uid`` is the uid, then every span of their traces that names no other
trajectory, and a span that links into them: a batch's conversion) and lays them out in start order:
when each began after the first, how long it took, and the gap since the rows above it had all ended
(time nobody on the trajectory's path was working on it; none while an earlier row still runs).

With tracing off there are no spans; the timeline is then its records': each step and end on the steps
topics (Kafka timestamp, partition and offset) and the group record that holds the trajectory. Where
nothing names the uid, ``TrajectoryNotFound``.

Reads with ``assign()`` and never commits.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from confluent_kafka import Consumer, Message, TopicPartition

from trajbus.infra.clients import reader
from trajbus.infra.span_names import BACKEND, OFFSET, OUTCOME, PARTITION, PROMPT_UID, STEP_INDEX, TOKENS
from trajbus.infra.topics import read_partition, watermarks
from trajbus.infra.trace_export import SpanDecodeError, SpanRecord, decode_span
from trajbus.streams.client.chunks import ChunkReader
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import StepDelta, step_of
from trajbus.streams.wire.records import ChunkedGroup, ReadyGroup, Step, TrajectoryEnd
from trajbus.streams.wire.topics import (DEFAULT_PREFIX, channel_of, groups_topic, steps_topic, traces_topic,
                                         validate_prefix)

__all__ = ["COLUMNS", "Timeline", "TimelineRow", "TrajectoryNotFound", "cells", "header", "read_timeline",
           "select_spans", "span_rows"]

log = logging.getLogger(__name__)

COLUMNS = ("+ms", "dur ms", "gap ms", "service", "span", "attributes")
_TRACE_KEY = re.compile(rb"[0-9a-f]{32}")
_MS = 1_000_000


class TrajectoryNotFound(LookupError):
    """No span and no record names the trajectory; the message says where it was looked for."""


@dataclass(frozen=True)
class TimelineRow:
    """One span (or, with tracing off, one record) of the timeline; times in ms."""

    start_ms: float
    """Since the first row's start."""
    duration_ms: float | None
    """None for a record: a point in time."""
    gap_ms: float | None
    """Since the latest end of the rows above; None while one of them still runs (and on the first row)."""
    service: str
    name: str
    attributes: Mapping[str, Any] = field(default_factory=dict)
    trace_id: str | None = None
    span_id: str | None = None
    parent_id: str | None = None
    status: str = "UNSET"


@dataclass(frozen=True)
class Timeline:
    trajectory_uid: str
    rows: list[TimelineRow]
    trace_ids: list[str]
    wall_ms: float
    source: str
    """``spans``, or ``records`` when tracing was off (no span of the trajectory)."""
    topics: list[str]
    """The topics the rows were read from."""

    @property
    def spans(self) -> int:
        return len(self.rows) if self.source == "spans" else 0

    def as_json(self) -> dict[str, Any]:
        return {"trajectory_uid": self.trajectory_uid, "trace_ids": self.trace_ids, "source": self.source,
                "wall_ms": round(self.wall_ms, 3), "spans": self.spans, "topics": self.topics,
                "rows": [{**asdict(row), "attributes": dict(row.attributes)} for row in self.rows]}


# -- which spans, in which order (pure) -------------------------------------------------------------

def select_spans(uid: str, records: Iterable[tuple[bytes | None, bytes | None]]) -> tuple[list[SpanRecord], int]:
    """The trajectory's spans among (key, value) records of the traces topic, and how many were undecodable.

    Keyed by the uid: the trajectory's own. Keyed by a trace id (a span that names no trajectory): kept when
    its trace is one of theirs or it links into one."""
    own: list[SpanRecord] = []
    unnamed: list[SpanRecord] = []
    wanted, bad = uid.encode(), 0
    for key, value in records:
        if key != wanted and not (key and _TRACE_KEY.fullmatch(key)):
            continue  # another trajectory's span: not decoded
        try:
            span = decode_span(value)
        except SpanDecodeError as exc:
            bad += 1
            log.debug("trace: skipped an undecodable span record: %s", exc)
            continue
        if span.trajectory_uid == uid:
            own.append(span)
        elif span.trajectory_uid is None:
            unnamed.append(span)
    traces = {span.trace_id for span in own}
    own += [span for span in unnamed
            if span.trace_id in traces or any(link.trace_id in traces for link in span.links)]
    return own, bad


@dataclass(frozen=True)
class _Event:
    start_ns: int
    end_ns: int | None
    service: str
    name: str
    attributes: Mapping[str, Any]
    trace_id: str | None = None
    span_id: str | None = None
    parent_id: str | None = None
    status: str = "UNSET"
    depth: int = 0
    """Ancestors among the timeline's spans: of two that start together, the parent comes first."""


def _ms(ns: int) -> float:
    return round(ns / _MS, 3)


def _rows(events: list[_Event]) -> list[TimelineRow]:
    """Events in start order (a parent before the child that starts with it), timed from the first."""
    events = sorted(events, key=lambda e: (e.start_ns, e.depth, -(e.end_ns or e.start_ns), e.name))
    rows: list[TimelineRow] = []
    latest_end: int | None = None
    for event in events:
        end = event.start_ns if event.end_ns is None else max(event.end_ns, event.start_ns)
        gap = None if latest_end is None or event.start_ns < latest_end else _ms(event.start_ns - latest_end)
        rows.append(TimelineRow(
            _ms(event.start_ns - events[0].start_ns), None if event.end_ns is None else _ms(end - event.start_ns),
            gap, event.service, event.name, dict(event.attributes), event.trace_id, event.span_id,
            event.parent_id, event.status))
        latest_end = end if latest_end is None else max(latest_end, end)
    return rows


def _depths(spans: list[SpanRecord]) -> dict[str, int]:
    """Per span id, how many of its ancestors are among ``spans`` (a parent not among them ends the chain)."""
    parents = {s.span_id: s.parent_id for s in spans}
    depths: dict[str, int] = {}
    for span_id in parents:
        seen, parent = {span_id}, parents[span_id]
        while parent in parents and parent not in seen:
            seen.add(parent)
            parent = parents[parent]
        depths[span_id] = len(seen) - 1
    return depths


def span_rows(spans: Iterable[SpanRecord]) -> list[TimelineRow]:
    """The timeline rows of spans (one a span)."""
    spans = list(spans)
    depths = _depths(spans)
    return _rows([_Event(s.start_ns, s.end_ns, s.service, s.name, s.attributes, s.trace_id, s.span_id,
                         s.parent_id, s.status, depths[s.span_id]) for s in spans])


def _wall_ms(rows: list[TimelineRow]) -> float:
    """From the first start to the last end."""
    return max((r.start_ms + (r.duration_ms or 0.0) for r in rows), default=0.0)


# -- what a person reads ------------------------------------------------------------------------------

_DETAILS = ((STEP_INDEX, "step"), (OUTCOME, "outcome"), (BACKEND, "backend"),
            (TOKENS, "tokens"))


def details(row: TimelineRow) -> str:
    """The row's key attributes, e.g. ``step=2 at=3@17 outcome=emitted tokens=12``."""
    attributes = row.attributes
    words = [f"{label}={attributes[name]}" for name, label in _DETAILS[:1] if name in attributes]
    if PARTITION in attributes and OFFSET in attributes:
        words.append(f"at={attributes[PARTITION]}@{attributes[OFFSET]}")
    words += [f"{label}={attributes[name]}" for name, label in _DETAILS[1:] if name in attributes]
    if row.status == "ERROR":
        words.append("status=ERROR")
    return " ".join(words)


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def cells(rows: Iterable[TimelineRow]) -> list[list[str]]:
    """The table's cells under ``COLUMNS`` (``pipelines.tables`` draws them)."""
    return [[_number(r.start_ms), _number(r.duration_ms), _number(r.gap_ms), r.service, r.name, details(r)]
            for r in rows]


def header(timeline: Timeline) -> str:
    """One line: the trajectory, its trace(s), wall time and span count (and why no spans, if none)."""
    traces = ",".join(timeline.trace_ids) or "-"
    line = (f"trajectory {timeline.trajectory_uid}  trace {traces}  wall {timeline.wall_ms:.1f} ms  "
            f"{timeline.spans} spans")
    if timeline.source == "records":
        line += f"  (tracing was off: the timeline of its records in {', '.join(timeline.topics)})"
    return line


# -- reading the topics -------------------------------------------------------------------------------

def _read(consumer: Consumer, topic: str, partitions: Iterable[int]) -> Iterator[Message]:
    """Every record of ``topic`` up to the end offsets it had when asked, partition after partition."""
    for partition in sorted(partitions):
        low, high = watermarks(consumer, TopicPartition(topic, partition), 10.0)
        yield from read_partition(consumer, topic, partition, low, high)


def _step_event(message: Message, record: Any) -> _Event:
    attributes: dict[str, Any] = {PARTITION: message.partition(), OFFSET: message.offset()}
    if isinstance(record, TrajectoryEnd):
        name = "end"
        attributes[PROMPT_UID] = record.prompt_uid
    else:
        step = step_of(record)
        name = "step"
        attributes.update({STEP_INDEX: step.step_index, PROMPT_UID: step.prompt_uid,
                           TOKENS: len(step.response_ids)})
    return _Event(message.timestamp()[1] * _MS, None, message.topic(), name, attributes)


def _group_event(message: Message, group: ReadyGroup) -> _Event:
    return _Event(message.timestamp()[1] * _MS, None, message.topic(), "group", {
        PARTITION: message.partition(), OFFSET: message.offset(),
        PROMPT_UID: group.prompt_uid, OUTCOME: group.status})


class _TopicReader:
    """The Kafka side of ``read_timeline``: one never-committing reader, and the chunks of large groups."""

    def __init__(self, bootstrap_servers: str, prefix: str) -> None:
        self.servers, self.prefix = bootstrap_servers, prefix
        self.consumer = reader(bootstrap_servers, {"group.id": f"{prefix}.trace.{uuid.uuid4().hex[:8]}",
                                                   "enable.partition.eof": True, "fetch.wait.max.ms": 50,
                                                   "logger": log})
        try:
            self.topics = self.consumer.list_topics(timeout=10).topics
        except BaseException:
            self.consumer.close()
            raise

    def spans(self, uid: str) -> list[SpanRecord]:
        topic = traces_topic(self.prefix)
        if topic not in self.topics:
            return []
        records = ((m.key(), m.value()) for m in _read(self.consumer, topic, self.topics[topic].partitions))
        spans, bad = select_spans(uid, records)
        if bad:
            log.warning("trace: %d undecodable record(s) of %s skipped", bad, topic)
        return spans

    def records(self, uid: str) -> tuple[list[_Event], list[str]]:
        """Events of the trajectory's steps and ends, and of the group that holds it; the topics they are in."""
        events: list[_Event] = []
        read_from: list[str] = []
        for channel in self._channels():
            topic = steps_topic(channel, self.prefix)
            found = list(self._records_of(topic, uid))
            if not found:
                continue
            events += [_step_event(message, record) for message, record in found]
            read_from.append(topic)
            groups = groups_topic(channel, self.prefix)
            if groups in self.topics:
                events += self._groups(groups, uid, _ids(found[0][1])[1])
                read_from.append(groups)
        return events, read_from

    def _channels(self) -> list[str]:
        """The channels of the prefix's steps topics (a topic that names no valid channel is none)."""
        channels = []
        for topic in sorted(self.topics):
            with contextlib.suppress(ValueError):
                if topic.startswith(f"{self.prefix}.steps."):
                    channels.append(channel_of(topic, self.prefix))
        return channels

    def _records_of(self, topic: str, uid: str) -> Iterator[tuple[Message, Any]]:
        """The steps and end of trajectory ``uid`` on a steps topic."""
        wanted = uid.encode()
        for message in _read(self.consumer, topic, self.topics[topic].partitions):
            if wanted not in (message.value() or b""):
                continue  # a record of another trajectory (uids are stored as UTF-8): not decoded
            record = _decoded(message)
            if isinstance(record, (Step, StepDelta, TrajectoryEnd)) and _ids(record)[0] == uid:
                yield message, record

    def _groups(self, topic: str, uid: str, prompt_uid: str) -> list[_Event]:
        if topic not in self.topics:
            return []
        chunks = ChunkReader(self.servers)
        try:
            events = []
            for message in _read(self.consumer, topic, self.topics[topic].partitions):
                if message.key() != prompt_uid.encode():
                    continue
                group = _decoded(message)
                try:
                    group = chunks.whole(group) if isinstance(group, ChunkedGroup) else group
                except codec.DecodeError as exc:
                    log.warning("trace: group %s at %s[%d]@%d unreadable: %s", prompt_uid, topic,
                                message.partition(), message.offset(), exc)
                    continue
                if isinstance(group, ReadyGroup) and uid in group.trajectory_uids:
                    events.append(_group_event(message, group))
            return events
        finally:
            chunks.close()

    def close(self) -> None:
        self.consumer.close()


def _decoded(message: Message) -> Any:
    try:
        return codec.decode(message.value())
    except codec.DecodeError:
        return None


def _ids(record: Step | StepDelta | TrajectoryEnd) -> tuple[str, str]:
    """(trajectory_uid, prompt_uid) of a steps-topic record."""
    named = record if isinstance(record, TrajectoryEnd) else step_of(record)
    return named.trajectory_uid, named.prompt_uid


def read_timeline(bootstrap_servers: str, uid: str, prefix: str = DEFAULT_PREFIX) -> Timeline:
    """The trajectory's timeline: its spans, else (tracing off) its records; ``TrajectoryNotFound``
    where neither names it. Raises ``ValueError`` for a bad uid or prefix."""
    if not uid or not uid.strip():
        raise ValueError("trajectory uid: must be a non-empty string")
    validate_prefix(prefix)
    topics = _TopicReader(bootstrap_servers, prefix)
    try:
        spans = topics.spans(uid)
        if spans:
            rows = span_rows(spans)
            return Timeline(uid, rows, sorted({s.trace_id for s in spans}), _wall_ms(rows), "spans",
                            [traces_topic(prefix)])
        events, read_from = topics.records(uid)
    finally:
        topics.close()
    if not events:
        raise TrajectoryNotFound(f"no span and no record of trajectory {uid!r} under prefix {prefix!r} (read "
                                 f"{traces_topic(prefix)} and {prefix}.steps.* to their ends)")
    rows = _rows(events)
    return Timeline(uid, rows, [], _wall_ms(rows), "records", read_from)
