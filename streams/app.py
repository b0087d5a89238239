"""The Faust stream processor: step events in, ready prompt groups out, exactly once per group.

One agent consumes ``{prefix}.steps.{channel}`` of every configured channel.
All assembly state lives in one Faust table, ``assembly``, backed by a compacted
changelog topic, so a worker that dies loses nothing and another worker can take
its partitions over. A pending group is stored as an index of its steps' source
offsets (``PendingGroup``), so an event writes bytes in proportion to the group's
step count, never its tokens; the bodies come from memory or the steps topic
(``StepBodies``) when the group is emitted. Keys start with their source partition
(see ``StateKey``): writes made outside an event (timeouts) still land in the right
changelog partition, and all state of a partition is ordered in one changelog partition.

Exactly once out, with at-least-once in:
- a group is written to ``{prefix}.groups.{channel}`` and its acknowledgement is
  awaited *before* the table records it as emitted: the groups topic is never
  behind the table;
- each emitted group carries its source partition and offset in headers, and
  the table keeps a per-partition watermark of the groups-topic offsets it has
  recorded; when a worker (re)gains a partition it reads the groups topic past
  that watermark and records what an earlier owner emitted but did not get to
  record: such groups are never emitted again;
- an event at or below an emitted group's last source offset is a replay
  (counted as duplicate); one above it is late and goes to the DLQ.

Nothing in, lost: the table also keeps each partition's applied source position
(``o`` keys). Faust's committed offsets are only where it resumes; where it
resumes past the table's position, or leaves a partition's tail undelivered
after a rebalance (both seen with faust-streaming 0.15), the range is read
directly and applied in order.

A group is emitted the moment it is ready, whatever older groups still wait.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from wsgiref.simple_server import WSGIServer
from typing import Any, Callable

import faust
from confluent_kafka import Producer
from prometheus_client import start_http_server

from trajbus.infra.kafka_config import client_config, faust_credentials
from trajbus.infra.topics import end_offsets_of
from trajbus.streams import codec
from trajbus.streams.assembly import Outcome, PendingGroup
from trajbus.streams.bodies import StepBodies
from trajbus.streams.dlq import dlq_headers
from trajbus.streams.faust_app import IdempotentApp, PartitionKeyedTable
from trajbus.streams.filters import judge
from trajbus.streams.policy import PolicyWatcher
from trajbus.streams.positions import SourcePositions
from trajbus.streams.queue_bound import bound_queues
from trajbus.streams.records import ReadyGroup, Step, TrajectoryEnd
from trajbus.streams.settings import WorkerSettings
from trajbus.streams.state_keys import (SOURCE_OFFSET, SOURCE_PARTITION, SourceRecord, StateKey, emitted_past,
                                        read_range)
from trajbus.streams.stats import WorkerMetrics, encode_snapshot
from trajbus.streams.topics import channel_of, dlq_topic, groups_topic, stats_topic, steps_topic

log = logging.getLogger("trajbus.worker")

DROP_TIMEOUT = "timeout"
TOO_LARGE = "too_large"
STEPS_EXPIRED = "steps_expired"
RECORD_OVERHEAD = 64 * 1024
"""Bytes a group record may need beyond its value (key, headers, batch framing), with a wide margin."""
EXPIRE_EVERY = 60.0
STATE_TABLE = "assembly"
"""The table (and ``{app_id}-assembly-changelog``); named anew when its values changed meaning: a
pending group is an index of source offsets now, no longer its steps."""


def _broker_urls(bootstrap_servers: str) -> list[str]:
    return [f"kafka://{server.strip()}" for server in bootstrap_servers.split(",") if server.strip()]


class GroupAssembler:
    """The worker's logic, wired to a Faust app by ``build_app``."""

    def __init__(self, app: faust.App, bootstrap_servers: str, settings: WorkerSettings) -> None:
        self.app = app
        self.bootstrap_servers = bootstrap_servers
        self.settings = settings
        self.prefix = settings.topics.prefix
        self.metrics = WorkerMetrics()
        self.state = app.tables.add(PartitionKeyedTable(
            app, name=STATE_TABLE, key_type=bytes, value_type=bytes, beacon=app.tables.beacon,
            partitions=settings.topics.steps_partitions,
            help="pending groups' step indexes, emitted markers and groups-topic watermarks, by source partition",
        ))
        self.bodies = StepBodies(settings.step_cache_bytes, self.read_steps, self.metrics.steps_read_back.inc)
        self.outputs = {c: app.topic(groups_topic(c, self.prefix), key_serializer="raw", value_serializer="raw")
                        for c in settings.channels}
        self.dlq = app.topic(dlq_topic(self.prefix), key_serializer="raw", value_serializer="raw")
        self.filters: dict[str, Callable | None] = {c: settings.channel(c).load_group_filter()
                                                    for c in settings.channels}
        self.locks: dict[int, asyncio.Lock] = {}
        self.reconciled: set[int] = set()
        self.positions = SourcePositions(self.state, bootstrap_servers, settings.app_id, self.prefix,
                                         settings.broker_outage_limit)
        self.policy: PolicyWatcher | None = None
        self.stats_producer: Producer | None = None
        self.metrics_server: WSGIServer | None = None
        self._last_expiry = 0.0
        self._last_stats = 0.0

    # -- helpers -------------------------------------------------------------------
    def read_steps(self, channel: str, partition: int, start: int, end: int) -> list[SourceRecord]:
        return read_range(self.bootstrap_servers, steps_topic(channel, self.prefix), partition, start, end)

    def lock(self, partition: int) -> asyncio.Lock:
        return self.locks.setdefault(partition, asyncio.Lock())

    def active_partitions(self) -> set[int]:
        topics = {steps_topic(c, self.prefix) for c in self.settings.channels}
        return {tp.partition for tp in self.app.assignor.assigned_actives() if tp.topic in topics}

    def keys_by_partition(self) -> dict[tuple[int, str], list[StateKey]]:
        """Every table key, decoded once, by (partition, kind)."""
        keys: dict[tuple[int, str], list[StateKey]] = defaultdict(list)
        for raw in list(self.state.keys()):
            key = StateKey.decode(raw)
            keys[(key.partition, key.kind)].append(key)
        return keys

    def current_version(self, channel: str) -> int | None:
        return self.policy.current(channel) if self.policy else None

    async def to_dlq(self, message: Any, channel: str, reason: str) -> None:
        headers = dlq_headers(message.headers, reason, message.topic, message.partition, message.offset)
        await (await self.dlq.send(key=message.key, value=message.value, headers=headers))
        self.metrics.dlq.labels(channel, reason.split(":", 1)[0]).inc()
        log.warning("dlq topic=%s partition=%d offset=%d reason=%s",
                    message.topic, message.partition, message.offset, reason)

    # -- events --------------------------------------------------------------------
    async def handle(self, event: faust.EventT) -> None:
        message = event.message
        partition = message.partition
        channel = channel_of(message.topic, self.prefix)
        self.positions.touched(channel, partition)
        async with self.lock(partition):
            await self.ensure_reconciled(partition)
            expected = await self.positions.start_of(channel, partition)
            if message.offset < expected:
                self.metrics.duplicates.labels(channel).inc()  # a replay: already applied
                return
            if message.offset > expected:
                # Faust resumed past what the table applied (it can drop records it
                # fetched during a rebalance): read the skipped range directly.
                await self.apply_range(channel, partition, expected, message.offset, "skipped by the consumer")
            await self.apply_at(channel, partition, message)

    async def apply_range(self, channel: str, partition: int, start: int, end: int, why: str) -> None:
        """Read ``start <= offset < end`` of a steps partition directly and apply what is still new."""
        topic = steps_topic(channel, self.prefix)
        log.warning("source offsets %d..%d of %s[%d] %s; reading them directly", start, end - 1, topic, partition,
                    why)
        for record in await asyncio.to_thread(read_range, self.bootstrap_servers, topic, partition, start, end):
            if record.offset >= self.positions.expected.get((channel, partition), start):
                await self.apply_at(channel, partition, record)

    async def apply_at(self, channel: str, partition: int, message: Any) -> None:
        try:
            await self.process(channel, partition, message)
        finally:
            self.positions.advance(channel, partition, message.offset)
            self.metrics.source_position.labels(channel, str(partition)).set(message.offset + 1)

    async def catch_up(self) -> None:
        """Apply records Faust never delivered: where a quiet partition's log ends past our
        position (Faust can resume a partition at its end after a rebalance, or never fetch an
        assigned partition at all, and then nothing would reveal the skip)."""
        quiet: list[tuple[str, int]] = []
        for partition in self.active_partitions():
            for channel in self.settings.channels:
                position = self.positions.known(channel, partition)
                if position is not None:  # an owned partition with nothing new still reports where it is
                    self.metrics.source_position.labels(channel, str(partition)).set(position)
                if self.positions.quiet(channel, partition):
                    quiet.append((channel, partition))
        if not quiet:
            return
        ends = await asyncio.to_thread(end_offsets_of, self.bootstrap_servers,
                                       [(steps_topic(c, self.prefix), p) for c, p in quiet])
        for channel, partition in quiet:
            end = ends[(steps_topic(channel, self.prefix), partition)]
            async with self.lock(partition):
                start = self.positions.known(channel, partition)
                if start is None and end > 0:  # never delivered: from where the worker group resumes
                    await self.ensure_reconciled(partition)
                    start = await self.positions.start_of(channel, partition)
                if start is not None and end > start:
                    await self.apply_range(channel, partition, start, end, "not delivered by the consumer")
            self.positions.touched(channel, partition)

    async def process(self, channel: str, partition: int, message: Any) -> None:
        """Decode, check and apply one event; what cannot be applied goes to the DLQ."""
        try:
            record = codec.decode(message.value)
            if not isinstance(record, (Step, TrajectoryEnd)):
                raise codec.DecodeError(f"a {type(record).__name__} does not belong on a steps topic")
            record.validate()
        except ValueError as exc:
            await self.to_dlq(message, channel, f"undecodable: {exc}")
            return
        if record.channel is not None and record.channel != channel:
            await self.to_dlq(message, channel,
                              f"channel_mismatch: record says {record.channel!r}, topic is {channel!r}")
            return
        self.metrics.events.labels(channel, "step" if isinstance(record, Step) else "trajectory_end").inc()
        await self.apply(partition, channel, record, message)

    async def apply(self, partition: int, channel: str, record: Step | TrajectoryEnd, message: Any) -> None:
        marker = self.state.get(StateKey(partition, "e", channel, record.prompt_uid).encode())
        if marker is not None:
            if message.offset <= json.loads(marker)["offset"]:
                self.metrics.duplicates.labels(channel).inc()  # a replay after a crash or rebalance
                return
            self.metrics.late.labels(channel).inc()
            await self.to_dlq(message, channel, f"late: group already {json.loads(marker)['outcome']}")
            return
        key = StateKey(partition, "g", channel, record.prompt_uid).encode()
        stored = self.state.get(key)
        group = PendingGroup.decode(stored) if stored is not None \
            else PendingGroup(prompt_uid=record.prompt_uid, channel=channel)
        if message.offset <= group.last_offset:
            self.metrics.duplicates.labels(channel).inc()  # replayed past a lagging saved position
            return
        uid = record.trajectory_uid  # the one trajectory an event can complete
        was_complete = uid in group.trajectories and group.is_complete(uid)
        outcome = group.add(record, message.offset, self.settings.channel(channel).n_rollouts)
        if outcome is Outcome.UNKNOWN_TRAJECTORY:
            await self.to_dlq(message, channel, f"unknown_trajectory: {record.trajectory_uid} has no steps")
            return
        if outcome is Outcome.DUPLICATE:
            self.metrics.duplicates.labels(channel).inc()
            return
        group.last_offset = message.offset
        if isinstance(record, Step):
            self.bodies.put((channel, partition), message.offset, message.value)
        if not was_complete and group.is_complete(uid):
            self.metrics.trajectories.labels(channel).inc()
        if outcome is Outcome.READY:
            await self.finish(partition, group, "complete")
        else:
            self.state[key] = group.encode()

    async def finish(self, partition: int, group: PendingGroup, status: str) -> None:
        """Filter, emit (acknowledged), then record the outcome; the pending state goes."""
        channel = group.channel
        rules = self.settings.channel(channel)
        try:
            bodies = await self.bodies.steps((channel, partition), group.chosen_offsets().values())
        except LookupError as exc:
            self.metrics.dropped.labels(channel, STEPS_EXPIRED).inc()
            log.error("group dropped channel=%s prompt_uid=%s reason=%s", channel, group.prompt_uid, exc)
            self.record_outcome(partition, group, f"dropped ({STEPS_EXPIRED})")
            return
        ready = group.to_ready_group(bodies, rules.n_rollouts, status=status)
        self.metrics.groups.labels(channel, "ready" if status == "complete" else status).inc()
        verdict = judge(ready, rules, self.current_version(channel), self.filters[channel])
        if verdict.staleness is not None:
            self.metrics.staleness.labels(channel).observe(verdict.staleness)
        if not verdict.keep:
            self.metrics.dropped.labels(channel, verdict.reason).inc()
            log.info("group dropped channel=%s prompt_uid=%s reason=%s", channel, group.prompt_uid, verdict.reason)
            self.record_outcome(partition, group, f"dropped ({verdict.reason})")
            return
        ready.ready_at = time.time()
        value = codec.encode(ready)
        if len(value) + RECORD_OVERHEAD > self.settings.topics.max_message_bytes:
            await self.refuse_oversized(partition, group, ready, len(value))
            return
        groups_partition, offset = await self.emit(partition, group, ready, value)
        # Marker before watermark: both go to one changelog partition, in order, so
        # a recovered watermark always implies the markers of the groups below it.
        self.record_outcome(partition, group, "emitted")
        self.advance_watermark(partition, channel, groups_partition, offset)

    async def refuse_oversized(self, partition: int, group: PendingGroup, ready: ReadyGroup, size: int) -> None:
        """A group no record can carry: its reason (not its body) to the DLQ, the group dropped; assembly of
        every other group goes on (a send of it would fail, and stop the agent for all its partitions)."""
        channel = group.channel
        reason = (f"{TOO_LARGE}: group of {size} bytes ({len(ready.trajectory_uids)} trajectories, "
                  f"{len(ready.steps)} steps) exceeds max.message.bytes {self.settings.topics.max_message_bytes}")
        headers = dlq_headers(codec.headers_for(ready), reason, steps_topic(channel, self.prefix), partition,
                              group.last_offset)
        await (await self.dlq.send(key=ready.prompt_uid.encode(), value=None, headers=headers))
        self.metrics.dlq.labels(channel, TOO_LARGE).inc()
        self.metrics.dropped.labels(channel, TOO_LARGE).inc()
        log.warning("group dropped channel=%s prompt_uid=%s reason=%s", channel, group.prompt_uid, reason)
        self.record_outcome(partition, group, f"dropped ({TOO_LARGE})")

    async def emit(self, partition: int, group: PendingGroup, ready: ReadyGroup, value: bytes) -> tuple[int, int]:
        """Write the group (``value``, encoded) and wait for the broker's acknowledgement; returns (partition,
        offset)."""
        headers = codec.headers_for(ready) + [
            (SOURCE_PARTITION, str(partition).encode()), (SOURCE_OFFSET, str(group.last_offset).encode()),
        ]
        sent = await self.outputs[group.channel].send(key=ready.prompt_uid.encode(), value=value,
                                                      headers=headers, timestamp=ready.ready_at)
        metadata = await sent  # the broker's acknowledgement, before the table says "emitted"
        self.metrics.groups.labels(group.channel, "emitted").inc()
        log.info("group emitted channel=%s prompt_uid=%s status=%s trajectories=%d steps=%d offset=%d",
                 group.channel, ready.prompt_uid, ready.status, len(ready.trajectory_uids), len(ready.steps),
                 metadata.offset)
        return metadata.partition, metadata.offset

    def record_outcome(self, partition: int, group: PendingGroup, outcome: str) -> None:
        self.state[StateKey(partition, "e", group.channel, group.prompt_uid).encode()] = json.dumps(
            {"offset": group.last_offset, "at": time.time(), "outcome": outcome}).encode()
        self.state.pop(StateKey(partition, "g", group.channel, group.prompt_uid).encode(), None)
        self.bodies.forget((group.channel, partition), group.offsets())

    def advance_watermark(self, partition: int, channel: str, groups_partition: int, offset: int) -> None:
        key = StateKey(partition, "w", channel).encode()
        marks = json.loads(self.state.get(key) or b"{}")
        if offset > marks.get(str(groups_partition), -1):
            marks[str(groups_partition)] = offset
            self.state[key] = json.dumps(marks).encode()

    # -- recovery ------------------------------------------------------------------
    def forget_positions(self) -> None:
        """After a rebalance, positions and reconciliation are re-read from the recovered table."""
        self.reconciled.clear()
        self.positions.forget()

    async def ensure_reconciled(self, partition: int) -> None:
        """Once per assignment: record what earlier owners emitted from this partition but did not record."""
        if partition in self.reconciled:
            return
        for channel in self.settings.channels:
            marks = json.loads(self.state.get(StateKey(partition, "w", channel).encode()) or b"{}")
            found = await asyncio.to_thread(emitted_past, self.bootstrap_servers, groups_topic(channel, self.prefix),
                                            partition, marks)
            for prompt_uid, (groups_partition, offset, source_offset) in found.items():
                marker = StateKey(partition, "e", channel, prompt_uid).encode()
                if self.state.get(marker) is None:
                    self.state[marker] = json.dumps(
                        {"offset": source_offset, "at": time.time(), "outcome": "emitted"}).encode()
                    stored = self.state.pop(StateKey(partition, "g", channel, prompt_uid).encode(), None)
                    if stored is not None:
                        self.bodies.forget((channel, partition), PendingGroup.decode(stored).offsets())
                    log.info("reconciled emitted group channel=%s prompt_uid=%s", channel, prompt_uid)
                self.advance_watermark(partition, channel, groups_partition, offset)
        self.reconciled.add(partition)

    # -- periodic work -------------------------------------------------------------
    def ready_for_periodic_work(self) -> bool:
        recovery = self.app.tables.recovery
        return not self.app.rebalancing and recovery.completed.is_set()

    async def tick(self) -> None:
        """Timeouts, expiry of emitted markers, queue bound, statistics."""
        if not self.ready_for_periodic_work():
            return
        now = time.time()
        pending_groups = {c: 0 for c in self.settings.channels}
        pending_trajectories = dict(pending_groups)
        expire = now - self._last_expiry > EXPIRE_EVERY
        keys = self.keys_by_partition()
        for partition in sorted(self.active_partitions()):
            async with self.lock(partition):
                await self.ensure_reconciled(partition)
                self.positions.save(partition)
                for key in keys.get((partition, "g"), []):
                    stored = self.state.get(key.encode())
                    if stored is None:
                        continue
                    group = PendingGroup.decode(stored)
                    rules = self.settings.channel(key.channel)
                    if rules.group_timeout is not None and now - group.first_seen > rules.group_timeout:
                        await self.time_out(partition, group)
                        continue
                    pending_groups[key.channel] += 1
                    pending_trajectories[key.channel] += len(group.trajectories)
                if expire:
                    self.expire_markers(keys.get((partition, "e"), []), now)
        if expire:
            self._last_expiry = now
        self.metrics.step_cache_bytes.set(self.bodies.bytes_in_use)
        for channel in self.settings.channels:
            self.metrics.pending_groups.labels(channel).set(pending_groups[channel])
            self.metrics.pending_trajectories.labels(channel).set(pending_trajectories[channel])
            version = self.current_version(channel)
            if version is not None:
                self.metrics.policy_version.labels(channel).set(version)
        await self.catch_up()
        if 0 in self.active_partitions():  # one worker bounds the queues, so drops are counted once
            await bound_queues(self.bootstrap_servers, self.settings, self.metrics)
        if now - self._last_stats >= self.settings.stats_interval:
            self._last_stats = now
            self.publish_stats()

    async def time_out(self, partition: int, group: PendingGroup) -> None:
        rules = self.settings.channel(group.channel)
        if len(group.complete_trajectories()) >= rules.min_rollouts:
            await self.finish(partition, group, "partial")
            return
        self.metrics.dropped.labels(group.channel, DROP_TIMEOUT).inc()
        log.info("group timed out channel=%s prompt_uid=%s complete=%d", group.channel, group.prompt_uid,
                 len(group.complete_trajectories()))
        self.record_outcome(partition, group, f"dropped ({DROP_TIMEOUT})")

    def expire_markers(self, markers: list[StateKey], now: float) -> None:
        """Emitted markers outlive late events for ``emitted_ttl``; then they go."""
        for key in markers:
            raw = self.state.get(key.encode())
            if raw is not None and now - json.loads(raw)["at"] > self.settings.emitted_ttl:
                self.state.pop(key.encode(), None)

    def publish_stats(self) -> None:
        if self.stats_producer is None:
            self.stats_producer = Producer(client_config(self.bootstrap_servers, {"logger": log, "linger.ms": 50}))
        self.stats_producer.produce(stats_topic(self.prefix), key=self.metrics.worker_id.encode(),
                                    value=encode_snapshot(self.metrics.snapshot()))
        self.stats_producer.poll(0)

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self.policy = PolicyWatcher(self.bootstrap_servers, self.prefix)
        if self.settings.metrics_port is not None:
            self.metrics_server, _thread = start_http_server(
                self.settings.metrics_port, addr=self.settings.metrics_host, registry=self.metrics.registry)
            log.info("metrics on http://%s:%d/metrics", self.settings.metrics_host, self.metrics_server.server_port)

    def stop(self) -> None:
        """Last statistics out, then every client and server this assembler started is closed."""
        if self.stats_producer is not None:
            self.publish_stats()
            self.stats_producer.flush(10)
            self.stats_producer.close()
            self.stats_producer = None
        if self.policy is not None:
            self.policy.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None


def build_app(bootstrap_servers: str, settings: WorkerSettings, datadir: Path) -> tuple[faust.App, GroupAssembler]:
    """A Faust app wired for ``settings``; run it with ``streams.worker.run_worker``."""
    app = IdempotentApp(
        settings.app_id,
        broker=_broker_urls(bootstrap_servers),
        broker_credentials=faust_credentials(),  # the same connection as every other client
        store="memory://",  # tables are rebuilt from their changelog topics on start
        datadir=str(datadir),  # Faust's local files; nothing in them outlives the process
        topic_partitions=settings.topics.steps_partitions,
        topic_replication_factor=settings.topics.replication_factor,
        topic_disable_leader=True,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        table_standby_replicas=0,
        # Latency over batching: a group should be fetchable milliseconds after its
        # last step, so the producer sends at once and offsets are committed every
        # 100 events or 0.5 s. Correctness does not rest on these commits: the table
        # holds its own source positions, so a longer interval only costs replay.
        producer_linger=0.0,
        stream_wait_empty=False,
        broker_commit_every=100,
        broker_commit_interval=0.5,
        # A dead worker's partitions move to the others after 10 s, not Faust's default 60 s.
        broker_session_timeout=10.0,
        broker_heartbeat_interval=1.0,
        producer_max_request_size=settings.topics.max_message_bytes,
        consumer_max_fetch_size=settings.topics.max_message_bytes,
    )
    assembler = GroupAssembler(app, bootstrap_servers, settings)

    source = app.topic(*(steps_topic(c, settings.topics.prefix) for c in settings.channels),
                       key_serializer="raw", value_serializer="raw")

    @app.agent(source)
    async def assemble(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await assembler.handle(event)

    @app.timer(1.0)
    async def periodic() -> None:
        try:
            await assembler.tick()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - periodic work retries next second; assembly goes on
            log.exception("periodic work failed; retrying in a second")

    @app.on_partitions_revoked.connect
    async def forget_positions_on_revoke(app: faust.App, revoked: set, **kwargs: Any) -> None:
        assembler.forget_positions()

    @app.on_partitions_assigned.connect
    async def forget_positions_on_assign(app: faust.App, assigned: set, **kwargs: Any) -> None:
        assembler.forget_positions()

    return app, assembler
