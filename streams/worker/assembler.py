"""The Faust stream processor: step events in, ready prompt groups out, exactly once per group.

``GroupAssembler`` takes each event Faust delivers and runs the periodic work; it owns its parts, each
given the parts it works with, never the assembler's methods: the typed state over the one table
(``streams.worker.state_store``), the applier of one event (``streams.worker.applier``), emission
(``streams.worker.emission``), reconciliation (``streams.worker.reconciliation``), recovery of a partition
(``streams.worker.recovery``), the applied source positions (``streams.worker.positions``), the step
bodies (``streams.worker.bodies``) and the partitions it holds with their locks
(``streams.worker.partitions``). The process's chores (policy watcher, statistics, metrics endpoint:
``streams.worker.chores``) are the process's; the assembler reads the policy versions and publishes
statistics through them. ``build_app`` wires it to a Faust app; without one (unit tests) it runs on a
dict and fakes.

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
(``streams.worker.reconciliation``); an event at or below an emitted group's last source offset
is a replay (counted as duplicate), one above it is late and goes to the DLQ.
Nothing in is lost: the table keeps each partition's applied source position
(``streams.worker.positions``), and what Faust skips or never delivers is read directly.

A group is emitted the moment it is ready, whatever older groups still wait.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, MutableMapping

import faust

from trajbus.infra.retry import retrying_async
from trajbus.streams.wire.topics import channel_of, steps_topic
from trajbus.streams.worker.applier import EventApplier
from trajbus.streams.worker.assignment_watch import watch_assignment
from trajbus.streams.worker.bodies import StepBodies
from trajbus.streams.worker.chores import PolicyVersions, StatsPublisher, WorkerChores
from trajbus.streams.worker.direct_reads import DirectReads
from trajbus.streams.worker.emission import Emission, GroupEmission
from trajbus.streams.worker.faust_classes import PartitionKeyedTable, worker_app
from trajbus.streams.worker.membership import announce_membership
from trajbus.streams.worker.outbox import Outbox, Sends
from trajbus.streams.worker.partitions import HeldPartitions
from trajbus.streams.worker.periodic import every
from trajbus.streams.worker.positions import SourcePositions
from trajbus.streams.worker.queue_bound import QueueBound
from trajbus.streams.worker.reconciliation import Reconciliation
from trajbus.streams.worker.recovery import PartitionRecovery, Recovery
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.settlement import Settlement
from trajbus.streams.worker.state_store import AssemblyState
from trajbus.streams.worker.stats import WorkerMetrics
from trajbus.streams.worker.table_recovery_watch import watch_recovery
from trajbus.streams.worker.traces import step_traces

log = logging.getLogger("trajbus.worker")

EXPIRE_EVERY = 60.0
TICK_INTERVAL = 1.0
"""Seconds between the end of one tick (``GroupAssembler.tick``) and the start of the next."""
STATE_TABLE = "assembly"
"""The table (and ``{app_id}-assembly-changelog``); named anew when its values changed meaning: a
pending group is an index of source offsets now, no longer its steps."""


class GroupAssembler:
    """The worker's logic: hands each event to its applier and runs the periodic work; owns its parts."""

    def __init__(self, settings: WorkerSettings, bootstrap_servers: str, table: MutableMapping[bytes, bytes],
                 sends: Sends, reads: DirectReads, metrics: WorkerMetrics, policy: PolicyVersions,
                 stats: StatsPublisher, active_partitions: Callable[[], set[int]],
                 recovered: Callable[[], bool]) -> None:
        """``table``: the Faust table (a dict in unit tests); ``policy`` and ``stats``: the process's chores it
        reads and publishes to (``streams.worker.chores``; the process starts and closes them);
        ``active_partitions()``: the steps partitions this worker holds; ``recovered()``: whether the table
        is recovered and no rebalance is under way."""
        self.settings, self.bootstrap_servers, self.metrics = settings, bootstrap_servers, metrics
        self.prefix = settings.topics.prefix
        self.policy, self.stats, self.recovered = policy, stats, recovered
        self.partitions = HeldPartitions(active_partitions)
        self.state = AssemblyState(table)
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
                                                filters, policy.current, self.traces)
        self.reconciliation = Reconciliation(settings, self.state, settlement, reads)
        self.applier = EventApplier(settings, metrics, self.state, self.positions, self.bodies, self.emission, sends,
                                    self.reconciliation, self.traces)
        self.recovery: Recovery = PartitionRecovery(settings, metrics, self.state, self.positions,
                                                    self.reconciliation, reads, self.applier, self.partitions)
        self.queue_bound = QueueBound(bootstrap_servers, settings, metrics)
        self._last_expiry = 0.0

    # -- events --------------------------------------------------------------------
    async def handle(self, event: faust.EventT) -> None:
        """Apply one event. An error never skips it: the partition's unflushed changes are dropped
        (``EventApplier.apply_at``) and the event is handled again, with backoff, through a leader election
        or a restart of a broker, for up to ``broker_outage_limit`` seconds (unless its partition moved to
        another worker meanwhile); past that the error stops the agent, and the event is read again
        from the saved position."""
        message = event.message
        where = f"event {message.topic}[{message.partition}]@{message.offset}"
        async for attempt in retrying_async(self.settings.broker_outage_limit, log, where):
            with attempt:
                if attempt.retry_state.attempt_number > 1 and message.partition not in self.partitions.active():
                    log.info("%s: its partition moved to another worker, which applies it", where)
                    return
                await self.handle_once(message)

    async def handle_once(self, message: Any) -> None:
        partition = message.partition
        channel = channel_of(message.topic, self.prefix)
        async with self.partitions.lock(partition):
            await self.reconciliation.ensure(partition)
            expected = await self.positions.start_of(channel, partition)
            if message.offset < expected:
                self.metrics.duplicates.labels(channel).inc()  # a replay: already applied
                return
            if message.offset > expected:
                # Faust resumed past what the table applied (it can drop records it
                # fetched during a rebalance), or an earlier try failed: read the range directly.
                await self.recovery.apply_range(channel, partition, expected, message.offset,
                                                "skipped by the consumer")
            await self.applier.apply_at(channel, partition, message)

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
        for partition in sorted(self.partitions.active()):
            async with self.partitions.lock(partition):
                await self.reconciliation.ensure(partition)
                self.flush(partition)
        pending = await self.sweep(now, expire)
        if expire:
            self._last_expiry = now
        self.metrics.step_cache_bytes.set(self.bodies.bytes_in_use)
        for channel in self.settings.channels:
            self.metrics.pending_groups.labels(channel).set(pending[channel][0])
            self.metrics.pending_trajectories.labels(channel).set(pending[channel][1])
            version = self.policy.current(channel)
            if version is not None:
                self.metrics.policy_version.labels(channel).set(version)
        await self.recovery.catch_up()
        if 0 in self.partitions.active():  # one worker bounds the queues, so drops are counted once
            await self.queue_bound.check()
        self.stats.publish_due(now)

    async def sweep(self, now: float, expire: bool) -> dict[str, tuple[int, int]]:
        """Groups past their channel's ``group_timeout`` time out; with ``expire``, emitted markers past
        ``emitted_ttl`` go. Returns, per channel, the groups and trajectories still pending."""
        pending = {c: (0, 0) for c in self.settings.channels}
        index = self.state.index()
        for partition in sorted(self.partitions.active()):
            async with self.partitions.lock(partition):
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


def changelog_topic_name(app: faust.App) -> str:
    """The worker table's changelog topic (``{app_id}-assembly-changelog``)."""
    return app.tables[STATE_TABLE].changelog_topic.get_topic_name()


def build_app(bootstrap_servers: str, settings: WorkerSettings, datadir: Path, metrics: WorkerMetrics,
              chores: WorkerChores) -> faust.App:
    """A Faust app wired for ``settings``; run it with ``streams.worker.process.run_worker``, which owns
    ``metrics`` and ``chores`` (and starts and closes the chores)."""
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

    assembler = GroupAssembler(settings, bootstrap_servers, table, Outbox(app, settings, metrics),
                               DirectReads(bootstrap_servers), metrics, chores.policy, chores.stats,
                               active_partitions, recovered)
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

    return app
