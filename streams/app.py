"""The Faust stream processor: step events in, ready prompt groups out, exactly once per group.

This module holds the events and the periodic work; emitting is ``streams.emission``,
recovering a partition ``streams.recovery``.

One agent consumes ``{prefix}.steps.{channel}`` of every configured channel.
All assembly state lives in one Faust table, ``assembly``, backed by a compacted
changelog topic, so a worker that dies loses nothing and another worker can take
its partitions over. A pending group is stored as an index of its steps' source
offsets (``PendingGroup``), so an event writes bytes in proportion to the group's
step count, never its tokens; the bodies come from memory or the steps topic
(``StepBodies``) when the group is emitted. Keys start with their source partition
(see ``StateKey``): writes made outside an event (timeouts) still land in the right
changelog partition, and all state of a partition is ordered in one changelog partition.

Exactly once out, with at-least-once in: a group is acknowledged on the groups
topic before the table records it (``streams.emission``), and a worker that
(re)gains a partition first records what an earlier owner emitted
(``streams.recovery``); an event at or below an emitted group's last source offset
is a replay (counted as duplicate), one above it is late and goes to the DLQ.
Nothing in is lost: the table keeps each partition's applied source position
(``streams.positions``), and what Faust skips or never delivers is read directly.

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

from trajbus.infra.clients import acked_producer
from trajbus.infra.retry import retrying_async
from trajbus.streams import codec, ledger
from trajbus.streams.assembly import Outcome, PendingGroup
from trajbus.streams.assignment_watch import watch_assignment
from trajbus.streams.bodies import StepBodies
from trajbus.streams.dlq import dlq_headers
from trajbus.streams.emission import PREFIX_MISMATCH, GroupEmission
from trajbus.streams.faust_app import PartitionKeyedTable, worker_app
from trajbus.streams.membership import announce_membership
from trajbus.streams.periodic import every
from trajbus.streams.policy import PolicyWatcher
from trajbus.streams.prefix import StepDelta, step_of
from trajbus.streams.positions import SourcePositions
from trajbus.streams.queue_bound import QueueBound
from trajbus.streams.recovery import PartitionRecovery
from trajbus.streams.recovery_watch import watch_recovery
from trajbus.streams.records import Step, TrajectoryEnd
from trajbus.streams.settings import WorkerSettings
from trajbus.streams.state_keys import SourceRecord, StateKey, read_range
from trajbus.streams.stats import WorkerMetrics, encode_snapshot
from trajbus.streams.topics import (channel_of, chunks_topic, dlq_topic, groups_topic, prompts_topic, stats_topic,
                                   steps_topic)

log = logging.getLogger("trajbus.worker")

EXPIRE_EVERY = 60.0
TICK_INTERVAL = 1.0
"""Seconds between the end of one tick (``GroupAssembler.tick``) and the start of the next."""
STATE_TABLE = "assembly"
"""The table (and ``{app_id}-assembly-changelog``); named anew when its values changed meaning: a
pending group is an index of source offsets now, no longer its steps."""


class GroupAssembler(PartitionRecovery, GroupEmission):
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
        self.chunk_outputs = {c: app.topic(chunks_topic(c, self.prefix), key_serializer="raw",
                                           value_serializer="raw") for c in settings.channels}
        self.ledgers = {c: app.topic(prompts_topic(c, self.prefix), key_serializer="raw", value_serializer="raw")
                        for c in settings.channels}
        self.dlq = app.topic(dlq_topic(self.prefix), key_serializer="raw", value_serializer="raw")
        self.filters: dict[str, Callable | None] = {c: settings.channel(c).load_group_filter()
                                                    for c in settings.channels}
        self.locks: dict[int, asyncio.Lock] = {}
        self.reconciled: set[int] = set()
        self.pending: dict[int, dict[bytes, PendingGroup]] = {}
        """Per source partition, pending groups changed since the last tick, by table key: written to
        the table once a tick, just before the positions they cover (``flush_pending``), so a group's
        index goes to the changelog once a second, not once per event."""
        self.positions = SourcePositions(self.state, bootstrap_servers, settings.app_id, self.prefix,
                                         settings.broker_outage_limit)
        self.queue_bound = QueueBound(bootstrap_servers, settings, self.metrics)
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
        """Apply one event. An error never skips it: the partition's unflushed changes are dropped
        (``apply_at``) and the event is handled again, with backoff, through a leader election or a
        restart of a broker, for up to ``broker_outage_limit`` seconds (unless its partition moved to
        another worker meanwhile); past that the error stops the agent, and the event is read again
        from the saved position."""
        message = event.message
        where = f"event {message.topic}[{message.partition}]@{message.offset}"
        async for attempt in retrying_async(self.settings.broker_outage_limit, log, where):
            with attempt:
                if attempt.retry_state.attempt_number > 1 and message.partition not in self.active_partitions():
                    log.info("%s: its partition moved to another worker, which applies it", where)
                    return
                await self.handle_once(message)

    async def handle_once(self, message: Any) -> None:
        partition = message.partition
        channel = channel_of(message.topic, self.prefix)
        async with self.lock(partition):
            await self.ensure_reconciled(partition)
            expected = await self.positions.start_of(channel, partition)
            if message.offset < expected:
                self.metrics.duplicates.labels(channel).inc()  # a replay: already applied
                return
            if message.offset > expected:
                # Faust resumed past what the table applied (it can drop records it
                # fetched during a rebalance), or an earlier try failed: read the range directly.
                await self.apply_range(channel, partition, expected, message.offset, "skipped by the consumer")
            await self.apply_at(channel, partition, message)

    async def apply_at(self, channel: str, partition: int, message: Any) -> None:
        """Apply one event; the position moves past it only once it is applied. An event that fails
        half-way leaves no trace: the partition's unflushed changes are dropped (``forget_partition``)
        and it is applied again from the saved position."""
        try:
            await self.process(channel, partition, message)
        except BaseException:
            self.forget_partition(partition)
            raise
        self.positions.advance(channel, partition, message.offset)
        self.metrics.source_position.labels(channel, str(partition)).set(message.offset + 1)

    async def process(self, channel: str, partition: int, message: Any) -> None:
        """Decode, check and apply one event; what cannot be applied goes to the DLQ."""
        try:
            record = codec.decode(message.value)
            if not isinstance(record, (Step, StepDelta, TrajectoryEnd)):
                raise codec.DecodeError(f"a {type(record).__name__} does not belong on a steps topic")
            event = step_of(record) if isinstance(record, StepDelta) else record
            event.validate()
        except ValueError as exc:
            await self.to_dlq(message, channel, f"undecodable: {exc}")
            return
        if event.channel is not None and event.channel != channel:
            await self.to_dlq(message, channel,
                              f"channel_mismatch: record says {event.channel!r}, topic is {channel!r}")
            return
        self.metrics.events.labels(channel, "trajectory_end" if isinstance(event, TrajectoryEnd) else "step").inc()
        await self.apply(partition, channel, record, message)

    async def apply(self, partition: int, channel: str, record: Step | StepDelta | TrajectoryEnd,
                    message: Any) -> None:
        delta, record = (record, step_of(record)) if isinstance(record, StepDelta) else (None, record)
        marker = self.state.get(StateKey(partition, "e", channel, record.prompt_uid).encode())
        if isinstance(record, TrajectoryEnd) and ledger.ABANDON in record.metadata:
            await self.abandon(partition, channel, record, message.offset, marker)
            return
        if marker is not None:
            if message.offset <= json.loads(marker)["offset"]:
                self.metrics.duplicates.labels(channel).inc()  # a replay after a crash or rebalance
                return
            self.metrics.late.labels(channel).inc()
            await self.to_dlq(message, channel, f"late: group already {json.loads(marker)['outcome']}")
            return
        key = StateKey(partition, "g", channel, record.prompt_uid).encode()
        group = self.pending_group(partition, key) or PendingGroup(prompt_uid=record.prompt_uid, channel=channel)
        if message.offset <= group.last_offset:
            self.metrics.duplicates.labels(channel).inc()  # replayed past a lagging saved position
            return
        uid = record.trajectory_uid  # the one trajectory an event can complete
        if delta is not None and delta.base_index not in group.trajectories.get(uid, {}):
            await self.to_dlq(message, channel, f"{PREFIX_MISMATCH}: step {uid}#{record.step_index} extends step "
                                                f"{delta.base_index}, which its trajectory does not have")
            return
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
            self.pending.setdefault(partition, {})[key] = group

    def pending_group(self, partition: int, key: bytes) -> PendingGroup | None:
        """A pending group as it stands: changed since the last tick, else as the table has it."""
        changed = self.pending.get(partition, {}).get(key)
        if changed is not None:
            return changed
        stored = self.state.get(key)
        return None if stored is None else PendingGroup.decode(stored)

    def flush_pending(self, partition: int) -> None:
        """The partition's changed groups to the table, then its positions: a saved position never
        covers an event whose group change is not in the table (the changelog keeps this order)."""
        for key, group in self.pending.pop(partition, {}).items():
            self.state[key] = group.encode()
        self.positions.save(partition)

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
        for partition in sorted(self.active_partitions()):
            async with self.lock(partition):
                await self.ensure_reconciled(partition)
                self.flush_pending(partition)
        keys = self.keys_by_partition()
        for partition in sorted(self.active_partitions()):
            async with self.lock(partition):
                for key in keys.get((partition, "g"), []):
                    group = self.pending_group(partition, key.encode())
                    if group is None:
                        continue
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
            await self.queue_bound.check()
        if now - self._last_stats >= self.settings.stats_interval:
            self._last_stats = now
            self.publish_stats()

    def expire_markers(self, markers: list[StateKey], now: float) -> None:
        """Emitted markers outlive late events for ``emitted_ttl``; then they go."""
        for key in markers:
            raw = self.state.get(key.encode())
            if raw is not None and now - json.loads(raw)["at"] > self.settings.emitted_ttl:
                self.state.pop(key.encode(), None)

    def publish_stats(self) -> None:
        if self.stats_producer is None:
            self.stats_producer = acked_producer(self.bootstrap_servers, {"logger": log, "linger.ms": 50})
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
    app = worker_app(bootstrap_servers, settings, datadir)
    assembler = GroupAssembler(app, bootstrap_servers, settings)

    source = app.topic(*(steps_topic(c, settings.topics.prefix) for c in settings.channels),
                       key_serializer="raw", value_serializer="raw")

    @app.agent(source)
    async def assemble(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await assembler.handle(event)

    every(app, TICK_INTERVAL, assembler.tick, "periodic work (timeouts, catch-up, statistics)")
    watch_recovery(app)
    watch_assignment(app, assembler)
    announce_membership(app, assembler)

    @app.on_partitions_revoked.connect
    async def forget_positions_on_revoke(app: faust.App, revoked: set, **kwargs: Any) -> None:
        assembler.forget_positions()

    @app.on_partitions_assigned.connect
    async def forget_positions_on_assign(app: faust.App, assigned: set, **kwargs: Any) -> None:
        assembler.forget_positions()

    return app, assembler
