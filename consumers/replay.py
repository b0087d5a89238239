"""Replay a channel's history: past rollouts as an off-policy dataset for a new experiment.

A window is given by offsets or wall-clock times (Kafka's offset-for-time
look-up), optionally narrowed to some policy versions. From the ``groups``
topic, replay is a straight read: ``groups()`` / ``batches()`` hand the groups
to a trainer, or ``into_channel()`` re-emits them into another channel that an
ordinary ``BatchConsumer`` reads. From the ``steps`` topic, ``into_channel()``
re-publishes the steps (optionally with another ``n_rollouts``) so a worker
re-assembles them under that channel's settings; a step whose prompt extends
one before the window (schema v2) is rebuilt by reading back from its keyframe.

Replay reads with ``assign()`` and never commits: the live trainer's consumer
group is not touched. Partitions are read one after another, each in offset
order, so replaying the same window twice gives the same records in the same
order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Iterator

from confluent_kafka import Consumer, TopicPartition

from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.clients import acked_producer, reader
from trajbus.infra.terminal import ProgressLine
from trajbus.infra.topics import ensure_topics, read_partition, watermarks
from trajbus.streams.client.chunks import ChunkReader, produce_group
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire import codec
from trajbus.streams.wire.headers import REPLAYED_FROM
from trajbus.streams.wire.prefix import PrefixError, PrefixResolver, StepDelta, step_of
from trajbus.streams.wire.records import ReadyGroup, Step, TrajectoryEnd
from trajbus.streams.wire.topics import DEFAULT_PREFIX, chunks_topic, groups_topic, steps_topic, validate_channel

log = logging.getLogger(__name__)

SOURCES = ("groups", "steps")


class ReplayError(ValueError):
    """A window or source that cannot be replayed; the message names the problem."""


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 time (a time without zone is UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ReplayError(f"time: {text!r} is neither unix seconds nor an ISO 8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


class _RateLimit:
    def __init__(self, per_second: float | None) -> None:
        self.interval = 1.0 / per_second if per_second else 0.0
        self.next = time.monotonic()

    def wait(self) -> None:
        if self.interval:
            now = time.monotonic()
            if self.next > now:
                time.sleep(self.next - now)
            self.next = max(now, self.next) + self.interval


class Replay:
    def __init__(self, channel: str, bootstrap_servers: str | None = None, prefix: str = DEFAULT_PREFIX,
                 source: str = "groups", start_time: float | None = None, end_time: float | None = None,
                 start_offset: int | None = None, end_offset: int | None = None,
                 policy_versions: set[int] | None = None, max_groups_per_s: float | None = None,
                 progress: ProgressLine | None = None) -> None:
        """``progress``: where to count the records read (a terminal's line; ``trajbus replay``'s)."""
        if source not in SOURCES:
            raise ReplayError(f"source: expected one of {SOURCES}, got {source!r}")
        try:
            self.channel = validate_channel(channel)
        except ValueError as exc:
            raise ReplayError(str(exc)) from None
        self.bootstrap_servers = resolve_bootstrap_servers(bootstrap_servers)
        self.prefix, self.source = prefix, source
        self.topic = groups_topic(channel, prefix) if source == "groups" else steps_topic(channel, prefix)
        self.policy_versions = policy_versions
        self.max_groups_per_s = max_groups_per_s
        self.progress = progress
        if start_time is not None and end_time is not None and end_time < start_time:
            raise ReplayError(f"window: the end ({end_time}) is before the start ({start_time})")
        if start_offset is not None and end_offset is not None and end_offset < start_offset:
            raise ReplayError(f"window: the end offset {end_offset} is before the start offset {start_offset}")
        self._consumer = reader(self.bootstrap_servers, {
            "group.id": f"{prefix}.replay.{uuid.uuid4().hex[:8]}",
            "enable.partition.eof": True, "fetch.wait.max.ms": 50, "logger": log})
        self.ranges = self._resolve(start_time, end_time, start_offset, end_offset)
        self._prefixes = PrefixResolver()
        self._lookback: Consumer | None = None
        self._chunks = ChunkReader(self.bootstrap_servers)

    # -- the window -------------------------------------------------------------
    def _resolve(self, start_time: float | None, end_time: float | None, start_offset: int | None,
                 end_offset: int | None) -> dict[int, tuple[int, int]]:
        """Per partition, the offsets ``[start, end)`` of the window."""
        topics = self._consumer.list_topics(timeout=10).topics
        if self.topic not in topics:
            raise ReplayError(f"channel {self.channel!r}: topic {self.topic} does not exist")
        partitions = sorted(topics[self.topic].partitions)
        if (start_offset is not None or end_offset is not None) and len(partitions) > 1:
            raise ReplayError(f"offsets: {self.topic} has {len(partitions)} partitions; give a time window instead")
        ranges = {}
        for p in partitions:
            low, high = watermarks(self._consumer, TopicPartition(self.topic, p), 10.0)
            start, end = low, high
            if start_offset is not None:
                if start_offset < low:
                    raise ReplayError(f"window: offset {start_offset} is before the earliest retained offset {low} "
                                      f"of {self.topic}")
                start = start_offset
            elif start_time is not None:
                start = self._offset_for_time(p, start_time, high)
                if low > 0 and start == low and self._timestamp_at(p, low) > start_time * 1000:
                    raise ReplayError(f"window: {start_time} is before the earliest retained data of {self.topic} "
                                      f"(records before offset {low} were deleted by retention)")
            if end_offset is not None:
                end = min(end_offset, high)
            elif end_time is not None:
                end = self._offset_for_time(p, end_time, high)
            ranges[p] = (start, max(start, end))
        return ranges

    def _offset_for_time(self, partition: int, seconds: float, high: int) -> int:
        [found] = self._consumer.offsets_for_times([TopicPartition(self.topic, partition, int(seconds * 1000))],
                                                   timeout=10)
        return high if found.offset < 0 else found.offset

    def _timestamp_at(self, partition: int, offset: int) -> int:
        for message in self._read(partition, offset, offset + 1):
            return message.timestamp()[1]
        return 0

    def _read(self, partition: int, start: int, end: int) -> Iterator[Any]:
        return read_partition(self._consumer, self.topic, partition, start, end)

    @property
    def total(self) -> int:
        return sum(end - start for start, end in self.ranges.values())

    def records(self) -> Iterator[tuple[Any, Any]]:
        """(message, decoded record) of the window, partition after partition, in offset order."""
        done = 0
        try:
            for partition, (start, end) in self.ranges.items():
                for message in self._read(partition, start, end):
                    done += 1
                    if self.progress is not None:
                        self.progress.update(f"replay {self.topic}: {done}/{self.total} records",
                                             final=done == self.total)
                    try:
                        yield message, self._whole(partition, message, codec.decode(message.value()))
                    except ValueError as exc:
                        if self.progress is not None:
                            self.progress.clear()  # a log line of its own, not one run into the count
                        log.warning("replay skips undecodable record %s[%d]@%d: %s", self.topic, partition,
                                    message.offset(), exc)
        finally:
            if self.progress is not None:
                self.progress.clear()  # what is printed next starts on a clean line

    def _whole(self, partition: int, message: Any, record: Any) -> Any:
        """A step with its whole prompt. One that extends a step before the window is resolved by
        reading back from its keyframe (found by time: a record's timestamp is its ``created_at``);
        raises ``PrefixError`` (a ``ValueError``) where that lies before the retained log. A chunked
        group is read from its chunks."""
        if not isinstance(record, (Step, StepDelta)):
            return self._chunks.whole(record)
        if isinstance(record, StepDelta) and not self._prefixes.knows(record):
            start = self._offset_for_time(partition, record.keyframe_at, message.offset())
            if self._lookback is None:
                self._lookback = reader(self.bootstrap_servers, {
                    "group.id": f"{self.prefix}.replay-lookback.{uuid.uuid4().hex[:8]}",
                    "enable.partition.eof": True, "logger": log})
            uid = record.step.trajectory_uid
            for earlier in read_partition(self._lookback, self.topic, partition, start, message.offset()):
                found = codec.decode(earlier.value())
                if isinstance(found, (Step, StepDelta)) and step_of(found).trajectory_uid == uid:
                    with contextlib.suppress(PrefixError):  # a step of the chain before its keyframe
                        self._prefixes.resolve(found)
        return self._prefixes.resolve(record)

    def _wanted(self, steps: list[Step]) -> bool:
        return self.policy_versions is None or all(
            s.policy_version in self.policy_versions and all(v in self.policy_versions for _, v in s.version_segments or ())
            for s in steps)

    # -- to a trainer -----------------------------------------------------------
    def groups(self) -> Iterator[ReadyGroup]:
        """The window's ready groups (groups source), optionally of some policy versions only."""
        if self.source != "groups":
            raise ReplayError("groups(): replay from the steps topic re-assembles; use into_channel()")
        limit = _RateLimit(self.max_groups_per_s)
        for _message, group in self.records():
            if isinstance(group, ReadyGroup) and self._wanted(group.steps):
                limit.wait()
                yield group

    def batches(self, n_groups: int, backend: Any) -> Iterator[Any]:
        """``DataProto`` batches of ``n_groups`` groups (the last may be smaller)."""
        pending: list[ReadyGroup] = []
        for group in self.groups():
            pending.append(group)
            if len(pending) == n_groups:
                yield backend.convert([s for g in pending for s in g.steps])
                pending = []
        if pending:
            yield backend.convert([s for g in pending for s in g.steps])

    def batch_of_step(self, step: int, run: str | None = None, as_: str = "groups", backend: Any = None) -> Any:
        """The batch trainer step ``step`` of ``run`` trained, from the trained log (``consumers.step_batch``):
        ``groups`` (``ReadyGroup``s), ``steps``, ``dataproto`` (with ``backend``) or ``samples`` (slime)."""
        from trajbus.consumers.step_batch import StepBatches

        with StepBatches(self.channel, self.bootstrap_servers, self.prefix, run) as batches:
            shapes = {"groups": batches.ready_groups, "steps": batches.step_records, "samples": batches.samples,
                      "dataproto": lambda n: batches.dataproto(n, backend)}
            if as_ not in shapes:
                raise ReplayError(f"as_: expected one of {', '.join(shapes)}, got {as_!r}")
            return shapes[as_](step)

    # -- into a channel ---------------------------------------------------------
    def into_channel(self, target: str, n_rollouts: int | None = None) -> int:
        """Re-emit the window into channel ``target``; returns how many records were written."""
        try:
            validate_channel(target)
        except ValueError as exc:
            raise ReplayError(str(exc)) from None
        if target == self.channel:
            raise ReplayError(f"into: replaying {self.channel!r} into itself would duplicate its data")
        settings = TopicSettings(prefix=self.prefix)
        ensure_topics(self.bootstrap_servers, settings.channel_specs(target) + settings.shared_specs())
        if self.source == "groups":
            return self._groups_into(target)
        return self._steps_into(target, n_rollouts)

    def _groups_into(self, target: str) -> int:
        producer = acked_producer(self.bootstrap_servers, {"compression.type": "lz4", "linger.ms": 5, "logger": log})
        settings = TopicSettings(prefix=self.prefix)
        errors: list = []
        written = 0
        try:
            for group in self.groups():
                produce_group(producer, groups_topic(target, self.prefix), chunks_topic(target, self.prefix),
                              dataclasses.replace(group, channel=target), [(REPLAYED_FROM, self.topic.encode())],
                              settings.max_message_bytes, lambda error, _m: errors.append(error) if error else None)
                producer.poll(0)
                written += 1
            if producer.flush(60) or errors:
                raise RuntimeError(f"replay into {target}: {len(errors) or 'some'} records not acknowledged")
        finally:
            producer.close()
        return written

    def _steps_into(self, target: str, n_rollouts: int | None) -> int:
        kept: set[str] = set()
        limit = _RateLimit(self.max_groups_per_s)
        pending: list[Step] = []
        written = 0
        with StepProducer(self.bootstrap_servers, prefix=self.prefix) as producer:
            def flush() -> int:
                count = producer.submit_steps(pending, channel=target) if pending else 0
                pending.clear()
                return count

            for _message, record in self.records():
                if isinstance(record, Step) and self._wanted([record]):
                    kept.add(record.trajectory_uid)
                    pending.append(dataclasses.replace(record, channel=target,
                                                       n_rollouts=n_rollouts or record.n_rollouts))
                    if record.is_last:
                        limit.wait()
                    if len(pending) >= 500:
                        written += flush()
                elif isinstance(record, TrajectoryEnd) and record.trajectory_uid in kept:
                    written += flush() + 1  # an end follows its trajectory's steps
                    producer.complete_trajectory(record.trajectory_uid, record.prompt_uid, record.reward,
                                                 channel=target, n_rollouts=n_rollouts or record.n_rollouts,
                                                 metadata=record.metadata)
                    limit.wait()
            written += flush()
        return written

    def close(self) -> None:
        self._consumer.close()
        self._chunks.close()
        if self._lookback is not None:
            self._lookback.close()

    def __enter__(self) -> "Replay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
