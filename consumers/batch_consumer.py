"""The trainer's view of trajbus: the next ready prompt group, FIFO by readiness.

Reads ``{prefix}.groups.{channel}`` in one consumer group per channel. Nothing is
committed behind the trainer's back: ``commit()`` makes the position after the
last group handed out durable when the trainer chooses (at-least-once), and
``state_dict()`` / ``load_state_dict()`` put the exact position in the trainer's
own checkpoint, so a restart from it neither skips nor repeats a group.

Data-parallel ranks read disjoint data: ``BatchConsumer(rank=r, world_size=W)`` is
assigned the partitions ``p`` of the groups topic with ``p % W == r`` and fetches
nothing else. A group is one record, so a whole prompt group lands on one rank; the
groups topic needs a multiple of ``W`` partitions (``--groups-partitions``), and with
exactly ``W`` each rank reads its groups FIFO by readiness from one log.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from trajbus.consumers import metrics
from trajbus.consumers.assignment import AssignmentCheck, watch_assignment
from trajbus.consumers.backends import TrainingBackend
from trajbus.consumers.channels import CHANNEL_GRACE, ChannelCheck
from trajbus.consumers.commits import GroupCommits
from trajbus.consumers.contact import ContactWatch
from trajbus.consumers.fetch_traces import fetch_traces
from trajbus.consumers.group_records import decode_group
from trajbus.consumers.rows import check_group
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.clients import acked_producer, trainer_consumer
from trajbus.infra.first_contact import CONNECT_TIMEOUT, first_contact
from trajbus.infra.outage import OUTAGE_LIMIT, KafkaUnreachable
from trajbus.infra.retry import retrying
from trajbus.infra.topics import watermarks
from trajbus.infra.tracing import OFF, configure
from trajbus.streams.client.chunks import ChunkReader
from trajbus.streams.client.dlq import dead_letter
from trajbus.streams.wire.prefix import StructuredGroup
from trajbus.streams.wire.records import ReadyGroup, Step
from trajbus.streams.wire.topics import DEFAULT_PREFIX, groups_topic, traces_topic, trainer_group_id, validate_channel

log = logging.getLogger(__name__)


class BatchConsumer:
    """Fetches ready prompt groups of one channel.

    A fetch returns ``None`` only when no group became ready in time, at a cluster that answers (or
    in an outage it rides through, up to ``outage_limit``). A wrong address is no ``None``: the first
    fetch (or a rank's construction) waits for the cluster's first answer up to ``connect_timeout``
    (``CONNECT_TIMEOUT``, 10 s, whatever its own timeout), unless a client of this process reached it
    before, and raises ``ClusterNotReached`` (a ``KafkaUnreachable``) naming the address. A channel without
    topics is no endless ``None`` either: once its groups topic is still missing ``channel_grace`` seconds
    (30) after the first fetch began, a fetch raises ``UnknownChannel`` naming the channels there are
    (``consumers.channels``; a rank waits for its topic instead: ``rank_partitions``).

    ``tracing`` (``off``, ``kafka``, ``otlp``: the workers' words) traces this process as ``trajbus-trainer``
    unless it traces already: a span per trajectory fetched and per batch converted (``consumers.fetch_traces``).
    """

    def __init__(
        self,
        channel: str = "train",
        bootstrap_servers: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        group_id: str | None = None,
        backend: TrainingBackend | None = None,
        outage_limit: float | None = OUTAGE_LIMIT,
        keep: Callable[[str], bool] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        tracing: str = OFF,
        channel_grace: float = CHANNEL_GRACE,
        **config: Any,
    ) -> None:
        self.channel = validate_channel(channel)
        self.prefix = prefix
        self.topic = groups_topic(channel, prefix)
        self.bootstrap_servers = resolve_bootstrap_servers(bootstrap_servers)
        self._tracing = configure("trajbus-trainer", tracing, self.bootstrap_servers, traces_topic(prefix))
        self._traces = fetch_traces(self.channel)
        self.group_id = group_id or trainer_group_id(channel, prefix)
        # No auto-commit (the role's default): commit() after the trainer used a batch, at-least-once.
        self._consumer = trainer_consumer(self.bootstrap_servers, self.group_id, {
            "logger": log,  # librdkafka logs as structured Python log lines, not raw stderr
            "fetch.wait.max.ms": 50,
            "queued.max.messages.kbytes": 16 * 1024,
            # A trainer that died frees its partitions in 10 s; one that trains for an
            # hour between two fetches keeps them.
            "session.timeout.ms": 10000,
            "max.poll.interval.ms": 3600 * 1000,
            "fetch.max.bytes": 64 * 1024 * 1024,
            **config,
        })
        self._dlq: Producer | None = None
        self._commits = GroupCommits(self._consumer, self.group_id, outage_limit or OUTAGE_LIMIT)
        self._chunks = ChunkReader(self.bootstrap_servers)
        self.backend = backend
        self._held: list[tuple[StructuredGroup, int, int]] = []
        """(group, partition, offset) fetched for a batch that timed out; they start the next batch."""
        self.trimmed = 0
        """Prefetched groups skipped because the queue bound had dropped them meanwhile."""
        self.outage_limit = outage_limit
        """Seconds the broker may be unreachable while fetching before ``KafkaUnreachable`` (None: forever)."""
        self.connect_timeout = connect_timeout
        """Seconds the first fetch waits for a cluster never reached before ``ClusterNotReached``."""
        self._contacted = False
        self._closing = False
        self._channel = ChannelCheck(self._consumer, self.topic, self.channel, self.prefix, self.bootstrap_servers,
                                     channel_grace)
        """Whether the channel exists, asked once it had ``channel_grace`` seconds to appear (``UnknownChannel``)."""
        self._watch = ContactWatch(self._consumer, self.topic, self.bootstrap_servers, outage_limit)
        """When the cluster was last heard, and the outage rule asked while fetches wait; no thread of its own."""
        self.keep = keep
        """Which groups (by ``prompt_uid``) this consumer hands out; the others are passed over."""
        self.fetched_bytes = 0
        """Bytes of groups-topic records received, those passed over included (what the broker served)."""
        self._positions: dict[int, int] = {}
        """Per partition, the offset after the last group handed to the trainer."""
        self.partitions: list[int] | None = None
        """A rank's own partitions of the groups topic (None: the consumer group shares them out)."""
        self.rank = rank or 0
        self.on_handed_out: Callable[[int, int, str], None] = lambda partition, offset, prompt_uid: None
        """Called with each group handed to the trainer (the trained log's ``StepRecorder`` listens)."""
        self._assignment: AssignmentCheck | None = None
        """Subscribed: a group holding none of the topic's partitions is made to share them out."""
        if world_size is None:
            self._assignment = watch_assignment(self._consumer, self.topic, self.group_id, self.bootstrap_servers,
                                                self._subscribe)
            self._subscribe()
        else:
            try:
                self._contact()
                self.partitions = rank_partitions(self._consumer, self.topic, rank, world_size)
                self._assign_own()
            except BaseException:
                self.close()
                raise

    def fetch_group(self, timeout: float | None = None) -> ReadyGroup | None:
        """The next ready group, or ``None`` if none arrives within ``timeout`` seconds
        (``None``: wait as long as it takes). A cluster never reached raises ``ClusterNotReached`` (the
        class docstring), a channel without topics ``UnknownChannel``; one unreachable past ``outage_limit``
        raises ``KafkaUnreachable``."""
        fetched = self._next(timeout)
        if fetched is None:
            return None
        group, partition, offset = fetched
        self._positions[partition] = offset + 1
        self.on_handed_out(partition, offset, group.prompt_uid)
        return group.ready()

    def _contact(self) -> None:
        """Wait for the cluster's first answer (the class docstring), once."""
        if not self._contacted:
            first_contact(self.bootstrap_servers, self.connect_timeout)
            self._contacted = True
            self._watch.heard()

    def _next(self, timeout: float | None) -> tuple[StructuredGroup, int, int] | None:
        asked_ns = time.time_ns() if self._traces is not None else 0
        self._contact()
        self._channel.fetching()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = 1.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                self._channel.check()
                return None
            message = self._consumer.poll(min(remaining, 1.0))
            self._commits.retry_pending()
            if message is None:
                self._watch.check(deadline)
                self._channel.check()
                if self._assignment is not None:
                    self._assignment.check()
                continue
            self._watch.heard()
            if message.error():
                self._channel.check()
                if message.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error on %s: %s", self.topic, message.error().str())
                continue
            size = len(message.value() or b"")
            self.fetched_bytes += size
            metrics.FETCHED_BYTES.labels(self.channel).inc(size)
            group = None if self._trimmed(message) else self._decode(message)
            if group is not None and self.keep is not None and not self.keep(group.prompt_uid):
                group = None
            if group is not None:
                metrics.GROUPS.labels(self.channel).inc()
                metrics.STEPS.labels(self.channel).inc(len(group.entries))
                metrics.QUEUE_WAIT.labels(self.channel).observe(max(0.0, time.time() - group.ready_at))
                if self._traces is not None:
                    self._traces.fetched(group.prompt_uid, dict.fromkeys(e.step.trajectory_uid for e in group.entries),
                                         message.partition(), message.offset(), message.headers(), asked_ns)
                return group, message.partition(), message.offset()
            if not self._held:  # a skipped record moves the position only if no group waits before it
                self._positions[message.partition()] = message.offset() + 1

    def fetch_dataproto(self, n_groups: int, timeout: float | None = None,
                        current_version: int | None = None) -> Any | None:
        """``n_groups`` ready groups converted in one batch by ``backend``, or ``None`` if
        they do not all arrive in time (those that did are kept for the next call).
        ``current_version`` (the trainer's policy) adds per-row staleness."""
        if self.backend is None:
            raise ValueError("backend: fetch_dataproto needs a TrainingBackend, "
                             "e.g. trajbus.consumers.backends.VerlBackend")
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._held) < n_groups:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            fetched = self._next(remaining)
            if fetched is None:
                return None
            self._held.append(fetched)
        taken, self._held = self._held[:n_groups], self._held[n_groups:]
        if self._traces is None:
            batch = self.backend.convert_groups([group for group, _, _ in taken], current_version)
        else:
            with self._traces.converting((partition, offset) for _, partition, offset in taken):
                batch = self.backend.convert_groups([group for group, _, _ in taken], current_version)
        for group, partition, offset in taken:
            self._positions[partition] = offset + 1
            self.on_handed_out(partition, offset, group.prompt_uid)
        return batch

    def drain(self, timeout: float = 60.0) -> list[ReadyGroup]:
        """Every group ready now (up to the log end at the call), once: for validation passes.
        The position is committed, so the next drain returns only groups that came since."""
        deadline = time.monotonic() + timeout
        ends: dict[int, int] | None = None
        groups: list[ReadyGroup] = []
        while True:
            assignment = self._consumer.assignment()
            if ends is None and assignment:
                ends = {tp.partition: watermarks(self._consumer, TopicPartition(self.topic, tp.partition), 10)[1]
                        for tp in assignment}
            if ends is not None and self._reached(ends):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"drain of {self.topic} did not reach the log end within {timeout}s")
            group = self.fetch_group(timeout=0.5)
            if group is not None:
                groups.append(group)
        self.commit()
        return groups

    def _reached(self, ends: dict[int, int]) -> bool:
        """Whether every partition is consumed up to ``ends`` (or holds nothing to consume)."""
        assignment = [TopicPartition(self.topic, p) for p in ends]
        consumed = {tp.partition: tp.offset for tp in self._consumer.position(assignment)}
        committed = {tp.partition: tp.offset for tp in self._consumer.committed(assignment, timeout=10)}
        for p, end in ends.items():
            start = watermarks(self._consumer, TopicPartition(self.topic, p), 10)[0]
            if max(consumed.get(p, -1), committed.get(p, -1), self._positions.get(p, -1), start) < end:
                return False
        return True

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this consumer stands: save it with the trainer's checkpoint."""
        return {"topic": self.topic, "group_id": self.group_id, "positions": dict(self._positions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly after the last group handed out before ``state_dict`` was taken,
        whatever the consumer group committed since: nothing is skipped or repeated."""
        if state.get("topic") != self.topic:
            raise ValueError(f"state: saved for topic {state.get('topic')!r}, this consumer reads {self.topic!r}")
        self._positions = {int(p): int(o) for p, o in state["positions"].items()}
        self._held.clear()
        if self.partitions is not None:
            self._assign_own()
            return
        assigned = self._consumer.assignment()
        for tp in assigned:
            if tp.partition in self._positions:  # partitions assigned later start there too (_on_assign)
                self._consumer.seek(TopicPartition(self.topic, tp.partition, self._positions[tp.partition]))

    def _subscribe(self) -> None:
        self._consumer.subscribe([self.topic], on_assign=self._on_assign)

    def _assign_own(self) -> None:
        """A rank's partitions (``_start_offsets``)."""
        self._consumer.assign(self._start_offsets(self.partitions or []))

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Resume where this consumer stands, not where the group last committed: a partition handed
        back after a rebalance (e.g. the session expired while the broker restarted) must not deliver
        again what the trainer already got. Groups held for an unfinished batch are read again. A consumer
        that is closing reads nothing more: it neither asks the group's commits nor takes the partitions."""
        if self._closing:
            return
        assigned = {tp.partition for tp in partitions}
        if assigned:
            self._channel.saw()
        self._held = [held for held in self._held if held[1] not in assigned]
        consumer.assign(self._start_offsets(sorted(assigned)))

    def _start_offsets(self, partitions: list[int]) -> list[TopicPartition]:
        """Each partition from this consumer's position (after ``load_state_dict`` too), else the group's
        commit, else the log start. The commits are asked here, retried through a coordinator's move:
        librdkafka's own look-up, answered "not coordinator" once, leaves a partition unfetched for
        good (librdkafka #5586; seen on a fresh 3-node cluster)."""
        unknown = [TopicPartition(self.topic, p) for p in partitions if p not in self._positions]
        committed: dict[int, int] = {}
        for attempt in retrying(self.outage_limit or OUTAGE_LIMIT, log, f"committed offsets of {self.group_id}"):
            with attempt:
                for tp in self._consumer.committed(unknown, timeout=10) if unknown else []:
                    if tp.error is not None:
                        raise KafkaException(tp.error)
                    committed[tp.partition] = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
        return [TopicPartition(self.topic, p, self._positions.get(p, committed.get(p, OFFSET_BEGINNING)))
                for p in partitions]

    def _trimmed(self, message: Message) -> bool:
        """Prefetched, but since dropped from the log by the worker's queue bound: the
        trainer wants the freshest groups the broker kept, not what sat in this process."""
        low, _high = self._consumer.get_watermark_offsets(
            TopicPartition(message.topic(), message.partition()), cached=True)
        if 0 <= message.offset() < low:
            self.trimmed += 1
            metrics.TRIMMED.labels(self.channel).inc()
            return True
        return False

    def fetch_batch(self, n_rollouts: int | None = None, timeout: float | None = None) -> list[Step] | None:
        """The steps of the next ready group, ordered by (trajectory_uid, step_index); ``None`` only when
        no group became ready within ``timeout``. A wrong address raises ``ClusterNotReached`` within
        ``connect_timeout`` (the class docstring); an outage past ``outage_limit``, ``KafkaUnreachable``."""
        group = self.fetch_group(timeout)
        if group is None:
            return None
        if n_rollouts is not None and len(group.trajectory_uids) != n_rollouts:
            raise ValueError(f"n_rollouts: group {group.prompt_uid} has {len(group.trajectory_uids)} "
                             f"trajectories, the caller expects {n_rollouts}")
        return check_group(group.steps)

    def _decode(self, message: Message) -> StructuredGroup | None:
        """Decode a group (a chunked one from its chunks), its prompts not rebuilt yet; anything else
        goes to the DLQ (never silently dropped)."""
        try:
            return decode_group(self._chunks, message.value())
        except ValueError as exc:
            reason = f"undecodable: {exc}"
        if self._dlq is None:
            self._dlq = acked_producer(self.bootstrap_servers, {"logger": log})
        dead_letter(self._dlq, self.prefix, message, reason, log)
        return None

    def commit(self) -> None:
        """Make the position after the last group handed out durable in the consumer group, through a
        coordinator's move; a consumer the group lost makes it once rejoined (``consumers.commits``)."""
        if self._positions:
            self._commits.commit([TopicPartition(self.topic, p, o) for p, o in self._positions.items()])

    def close(self) -> None:
        """Leave the consumer group (without committing: call ``commit()`` first)."""
        self._closing = True  # a rebalance served while leaving assigns nothing (``_on_assign``)
        self._consumer.close()
        self._chunks.close()
        if self._dlq is not None:
            self._dlq.flush(30)
            self._dlq.close()
        self._tracing.shutdown()  # this consumer's spans out

    def __enter__(self) -> "BatchConsumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rank_partitions(consumer: Consumer, topic: str, rank: int | None, world_size: int,
                    timeout: float = 60.0) -> list[int]:
    """The partitions of ``topic`` that ``rank`` of ``world_size`` reads: ``p % world_size == rank``.
    Waits (up to ``timeout``) for a topic the worker has not created yet."""
    if type(world_size) is not int or world_size < 1 or type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank!r} is not a rank of world_size {world_size!r} (0 <= rank < world_size)")
    deadline = time.monotonic() + timeout
    while True:
        metadata = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if metadata is not None and metadata.error is None and metadata.partitions:
            break
        if time.monotonic() > deadline:
            raise KafkaUnreachable(f"topic {topic}: no partitions after {timeout:.0f}s (is a worker running?)")
        time.sleep(0.5)
    count = len(metadata.partitions)
    if count % world_size:
        raise ValueError(f"world_size: {topic} has {count} partitions, and {world_size} ranks need a multiple of "
                         f"{world_size} to read disjoint shares (--groups-partitions)")
    return [p for p in range(count) if p % world_size == rank]


def drain(channel: str = "val", bootstrap_servers: str | None = None, prefix: str = DEFAULT_PREFIX,
          timeout: float = 60.0) -> list[ReadyGroup]:
    """Every ready group of ``channel`` not drained before, once (validation sets)."""
    with BatchConsumer(channel, bootstrap_servers, prefix=prefix) as consumer:
        return consumer.drain(timeout)
