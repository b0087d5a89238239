"""The Faust stream processor: step events in, ready prompt groups out, exactly once per group.

``GroupAssembler`` applies the events and runs the periodic work; it owns its parts, each
given its collaborators: the typed state over the one table (``streams.worker.state_store``),
emission (``streams.worker.emission``), recovery of a partition (``streams.worker.recovery``), the
applied source positions (``streams.worker.positions``) and the step bodies (``streams.worker.bodies``).
``build_app`` wires it to a Faust app; without one (unit tests) it runs on a dict and fakes.

One agent consumes ``{prefix}.steps.{channel}`` of every configured channel.
All assembly state lives in one Faust table, ``assembly``, backed by a compacted
changelog topic, so a worker that dies loses nothing and another worker can take
its partitions over. A pending group is stored as an index of its steps' source
offsets (``PendingGroup``), so an event writes bytes in proportion to the group's
step count, never its tokens; the bodies come from memory or the steps topic
(``StepBodies``) when the group is emitted. Keys start with their source partition
(see ``state_store``): writes made outside an event (timeouts) still land in the right
changelog partition, and all state of a partition is ordered in one changelog partition.

Exactly once out, with at-least-once in: a group is acknowledged on the groups
topic before the table records it (``streams.worker.emission``), and a worker that
(re)gains a partition first records what an earlier owner emitted
(``streams.worker.recovery``); an event at or below an emitted group's last source offset
is a replay (counted as duplicate), one above it is late and goes to the DLQ.
Nothing in is lost: the table keeps each partition's applied source position
(``streams.worker.positions``), and what Faust skips or never delivers is read directly.

A group is emitted the moment it is ready, whatever older groups still wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Callable, MutableMapping
from wsgiref.simple_server import WSGIServer

import faust
from confluent_kafka import Producer
from prometheus_client import start_http_server

from trajbus.infra.clients import acked_producer
from trajbus.infra.retry import retrying_async
from trajbus.streams.wire import codec
from trajbus.streams.wire import ledger
from trajbus.streams.worker.assembly import Outcome
from trajbus.streams.worker.assignment_watch import watch_assignment
from trajbus.streams.worker.bodies import StepBodies
from trajbus.streams.worker.direct_reads import DirectReads
from trajbus.streams.client.dlq import DeadLetter
from trajbus.streams.worker.emission import PREFIX_MISMATCH, Emission, GroupEmission
from trajbus.streams.worker.faust_classes import PartitionKeyedTable, worker_app
from trajbus.streams.worker.membership import announce_membership
from trajbus.streams.worker.outbox import Outbox, Sends
from trajbus.streams.worker.periodic import every
from trajbus.streams.client.policy import PolicyWatcher
from trajbus.streams.worker.positions import SourcePositions
from trajbus.streams.wire.prefix import StepDelta, step_of
from trajbus.streams.worker.queue_bound import QueueBound
from trajbus.streams.wire.records import Step, TrajectoryEnd
from trajbus.streams.worker.recovery import PartitionRecovery, Recovery
from trajbus.streams.worker.table_recovery_watch import watch_recovery
from trajbus.streams.worker.traces import step_traces
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.settlement import Settlement
from trajbus.streams.worker.state_store import AssemblyState
from trajbus.streams.worker.stats import WorkerMetrics, encode_snapshot
from trajbus.streams.wire.topics import channel_of, stats_topic, steps_topic

log = logging.getLogger("trajbus.worker")

EXPIRE_EVERY = 60.0
TICK_INTERVAL = 1.0
"""Seconds between the end of one tick (``GroupAssembler.tick``) and the start of the next."""
STATE_TABLE = "assembly"
"""The table (and ``{app_id}-assembly-changelog``); named anew when its values changed meaning: a
pending group is an index of source offsets now, no longer its steps."""


class GroupAssembler:
    """The worker's logic: applies step events to its state; owns emission and recovery as parts."""

    def __init__(self, settings: WorkerSettings, bootstrap_servers: str, table: MutableMapping[bytes, bytes],
                 sends: Sends, reads: DirectReads, metrics: WorkerMetrics, active_partitions: Callable[[], set[int]],
                 recovered: Callable[[], bool]) -> None:
        """``table``: the Faust table (a dict in unit tests); ``active_partitions()``: the steps partitions
        this worker holds; ``recovered()``: whether the table is recovered and no rebalance is under way."""
        self.settings, self.bootstrap_servers, self.metrics = settings, bootstrap_servers, metrics
        self.prefix = settings.topics.prefix
        self.active_partitions, self.recovered = active_partitions, recovered
        self.state = AssemblyState(table)
        self.sends = sends
        self.bodies = StepBodies(settings.step_cache_bytes,
                                 lambda channel, partition, start, end: reads.read_range(
                                     steps_topic(channel, self.prefix), partition, start, end),
                                 metrics.steps_read_back.inc)
        self.positions = SourcePositions(self.state, bootstrap_servers, settings.app_id, self.prefix,
                                         settings.broker_outage_limit)
        settlement = Settlement(self.state, sends, self.bodies)
        filters = {c: settings.channel(c).load_group_filter() for c in settings.channels}
        self.traces = step_traces()  # None unless tracing is on (``streams.worker.traces``)
        self.emission: Emission = GroupEmission(settings, metrics, self.state, self.bodies, sends, settlement,
                                                filters, self.current_version, self.traces)
        self.recovery: Recovery = PartitionRecovery(settings, metrics, self.state, self.positions, settlement, reads,
                                                    self.apply_at, self.lock, active_partitions)
        self.queue_bound = QueueBound(bootstrap_servers, settings, metrics)
        self.locks: dict[int, asyncio.Lock] = {}
        self.policy: PolicyWatcher | None = None
        self.stats_producer: Producer | None = None
        self.metrics_server: WSGIServer | None = None
        self._last_expiry = 0.0
        self._last_stats = 0.0

    def lock(self, partition: int) -> asyncio.Lock:
        return self.locks.setdefault(partition, asyncio.Lock())

    def current_version(self, channel: str) -> int | None:
        return self.policy.current(channel) if self.policy else None

    async def to_dlq(self, message: Any, channel: str, reason: str) -> None:
        letter = DeadLetter(message.key, message.value, reason, message.topic, message.partition, message.offset,
                            message.headers)
        await self.sends.dead_letter(channel, letter)

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
            await self.recovery.ensure_reconciled(partition)
            expected = await self.positions.start_of(channel, partition)
            if message.offset < expected:
                self.metrics.duplicates.labels(channel).inc()  # a replay: already applied
                return
            if message.offset > expected:
                # Faust resumed past what the table applied (it can drop records it
                # fetched during a rebalance), or an earlier try failed: read the range directly.
                await self.recovery.apply_range(channel, partition, expected, message.offset,
                                                "skipped by the consumer")
            await self.apply_at(channel, partition, message)

    async def apply_at(self, channel: str, partition: int, message: Any) -> None:
        """Apply one event; the position moves past it only once it is applied. An event that fails
        half-way leaves no trace: the partition's unflushed changes are dropped (``Recovery.forget_partition``)
        and it is applied again from the saved position."""
        try:
            await self.process(channel, partition, message)
        except BaseException:
            self.recovery.forget_partition(partition)
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
        if self.traces is None:
            await self.apply(partition, channel, record, message)
            return
        with self.traces.applying(channel, partition, message, event):
            await self.apply(partition, channel, record, message)

    async def apply(self, partition: int, channel: str, record: Step | StepDelta | TrajectoryEnd,
                    message: Any) -> None:
        """One decoded event against its group: a group with an outcome takes replays (counted) and sends
        late events to the DLQ; an abandon goes to emission; any other event is added to the group."""
        event = step_of(record) if isinstance(record, StepDelta) else record
        if isinstance(event, TrajectoryEnd) and ledger.ABANDON in event.metadata:
            await self.emission.abandon(partition, channel, event, message.offset)
            return
        marker = self.state.marker(partition, channel, event.prompt_uid)
        if marker is None:
            await self.add(partition, channel, record, message)
        elif message.offset <= marker.offset:
            self.metrics.duplicates.labels(channel).inc()  # a replay after a crash or rebalance
        else:
            self.metrics.late.labels(channel).inc()
            await self.to_dlq(message, channel, f"late: group already {marker.outcome}")

    async def add(self, partition: int, channel: str, record: Step | StepDelta | TrajectoryEnd,
                  message: Any) -> None:
        """Add an event to its pending group; a group it makes ready is finished (emitted or dropped)."""
        delta, event = (record, step_of(record)) if isinstance(record, StepDelta) else (None, record)
        group = self.state.open_group(partition, channel, event.prompt_uid)
        if message.offset <= group.last_offset:
            self.metrics.duplicates.labels(channel).inc()  # replayed past a lagging saved position
            return
        uid = event.trajectory_uid  # the one trajectory an event can complete
        if delta is not None and delta.base_index not in group.trajectories.get(uid, {}):
            await self.to_dlq(message, channel, f"{PREFIX_MISMATCH}: step {uid}#{event.step_index} extends step "
                                                f"{delta.base_index}, which its trajectory does not have")
            return
        was_complete = uid in group.trajectories and group.is_complete(uid)
        outcome = group.add(event, message.offset, self.settings.channel(channel).n_rollouts)
        if outcome is Outcome.UNKNOWN_TRAJECTORY:
            await self.to_dlq(message, channel, f"unknown_trajectory: {uid} has no steps")
            return
        if outcome is Outcome.DUPLICATE:
            self.metrics.duplicates.labels(channel).inc()
            return
        group.last_offset = message.offset
        if isinstance(event, Step):
            self.bodies.put((channel, partition), message.offset, message.value)
        if not was_complete and group.is_complete(uid):
            self.metrics.trajectories.labels(channel).inc()
        if outcome is Outcome.READY:
            await self.emission.finish(partition, group, "complete")
        else:
            self.state.update_group(partition, group)

    def flush(self, partition: int) -> None:
        """The partition's changed groups to the table, then its positions: a saved position never
        covers an event whose group change is not in the table (the changelog keeps this order)."""
        self.state.flush(partition)
        self.positions.save(partition)

    # -- periodic work -------------------------------------------------------------
    async def tick(self) -> None:
        """Changes flushed, timeouts, expiry of emitted markers, catch-up, queue bound, statistics."""
        if not self.recovered():
            return
        now = time.time()
        expire = now - self._last_expiry > EXPIRE_EVERY
        for partition in sorted(self.active_partitions()):
            async with self.lock(partition):
                await self.recovery.ensure_reconciled(partition)
                self.flush(partition)
        pending = await self.sweep(now, expire)
        if expire:
            self._last_expiry = now
        self.metrics.step_cache_bytes.set(self.bodies.bytes_in_use)
        for channel in self.settings.channels:
            self.metrics.pending_groups.labels(channel).set(pending[channel][0])
            self.metrics.pending_trajectories.labels(channel).set(pending[channel][1])
            version = self.current_version(channel)
            if version is not None:
                self.metrics.policy_version.labels(channel).set(version)
        await self.recovery.catch_up()
        if 0 in self.active_partitions():  # one worker bounds the queues, so drops are counted once
            await self.queue_bound.check()
        if now - self._last_stats >= self.settings.stats_interval:
            self._last_stats = now
            self.publish_stats()

    async def sweep(self, now: float, expire: bool) -> dict[str, tuple[int, int]]:
        """Groups past their channel's ``group_timeout`` time out; with ``expire``, emitted markers past
        ``emitted_ttl`` go. Returns, per channel, the groups and trajectories still pending."""
        pending = {c: (0, 0) for c in self.settings.channels}
        index = self.state.index()
        for partition in sorted(self.active_partitions()):
            async with self.lock(partition):
                for group in list(self.state.pending_groups(partition, index)):
                    timeout = self.settings.channel(group.channel).group_timeout
                    if timeout is not None and now - group.first_seen > timeout:
                        await self.emission.time_out(partition, group)
                        continue
                    groups, trajectories = pending[group.channel]
                    pending[group.channel] = (groups + 1, trajectories + len(group.trajectories))
                if expire:
                    self.state.expire_markers(partition, index, now, self.settings.emitted_ttl)
        return pending

    def publish_stats(self, stopped: bool = False) -> None:
        """This worker's snapshot on the stats topic; ``stopped``: its last (``trajbus stats`` counts it
        as live no longer)."""
        if self.stats_producer is None:
            self.stats_producer = acked_producer(self.bootstrap_servers, {"logger": log, "linger.ms": 50})
        self.stats_producer.produce(stats_topic(self.prefix), key=self.metrics.worker_id.encode(),
                                    value=encode_snapshot(self.metrics.snapshot(stopped)))
        self.stats_producer.poll(0)

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self.policy = PolicyWatcher(self.bootstrap_servers, self.prefix)
        if self.settings.metrics_port is not None:
            self.metrics_server, _thread = start_http_server(
                self.settings.metrics_port, addr=self.settings.metrics_host, registry=self.metrics.registry)
            log.info("metrics on http://%s:%d/metrics", self.settings.metrics_host, self.metrics_server.server_port)

    def stop(self) -> None:
        """Last statistics out, marked stopped, then every client and server this assembler started is closed."""
        if self.stats_producer is not None:
            self.publish_stats(stopped=True)
            self.stats_producer.flush(10)
            self.stats_producer.close()
            self.stats_producer = None
        if self.policy is not None:
            self.policy.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None


def changelog_topic_name(app: faust.App) -> str:
    """The worker table's changelog topic (``{app_id}-assembly-changelog``)."""
    return app.tables[STATE_TABLE].changelog_topic.get_topic_name()


def build_app(bootstrap_servers: str, settings: WorkerSettings, datadir: Path) -> tuple[faust.App, GroupAssembler]:
    """A Faust app wired for ``settings``; run it with ``streams.worker.process.run_worker``."""
    app = worker_app(bootstrap_servers, settings, datadir)
    table = app.tables.add(PartitionKeyedTable(
        app, name=STATE_TABLE, key_type=bytes, value_type=bytes, beacon=app.tables.beacon,
        partitions=settings.topics.steps_partitions,
        help="pending groups' step indexes, emitted markers and groups-topic watermarks, by source partition",
    ))
    sources = [steps_topic(c, settings.topics.prefix) for c in settings.channels]

    def active_partitions() -> set[int]:
        return {tp.partition for tp in app.assignor.assigned_actives() if tp.topic in sources}

    def recovered() -> bool:
        return not app.rebalancing and app.tables.recovery.completed.is_set()

    metrics = WorkerMetrics()
    assembler = GroupAssembler(settings, bootstrap_servers, table, Outbox(app, settings, metrics),
                               DirectReads(bootstrap_servers), metrics, active_partitions, recovered)
    source = app.topic(*sources, key_serializer="raw", value_serializer="raw")

    @app.agent(source)
    async def assemble(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await assembler.handle(event)

    every(app, TICK_INTERVAL, assembler.tick, "periodic work (timeouts, catch-up, statistics)")
    watch_recovery(app)
    watch_assignment(app, settings, metrics, changelog_topic_name(app))
    announce_membership(app, assembler)

    @app.on_partitions_revoked.connect
    async def forget_positions_on_revoke(app: faust.App, revoked: set, **kwargs: Any) -> None:
        assembler.recovery.forget()

    @app.on_partitions_assigned.connect
    async def forget_positions_on_assign(app: faust.App, assigned: set, **kwargs: Any) -> None:
        assembler.recovery.forget()

    return app, assembler
