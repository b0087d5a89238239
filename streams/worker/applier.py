"""Applying one steps record to the worker's state, its source position after it.

A record is decoded and checked (what cannot be applied goes to the DLQ), then applied to its group:
a group with an outcome takes replays (counted) and sends late events to the DLQ, an abandon goes to
emission, any other event is added to its pending group, and a group it makes ready is finished.

The assembler applies what Faust delivers, recovery what it reads directly (``streams.worker.recovery``):
both through this one part, which the assembler owns and hands to recovery. An event that fails
half-way leaves no trace: its partition's held changes and position are dropped and the partition is
reconciled again (``streams.worker.reconciliation``), so it is applied again from the saved position.
"""

from __future__ import annotations

from typing import Any

from trajbus.streams.client.dlq import DeadLetter
from trajbus.streams.wire import codec
from trajbus.streams.wire import ledger
from trajbus.streams.wire.prefix import StepDelta, step_of
from trajbus.streams.wire.records import Step, TrajectoryEnd
from trajbus.streams.worker.assembly import EventEffect
from trajbus.streams.worker.bodies import StepBodies
from trajbus.streams.worker.emission import PREFIX_MISMATCH, Emission
from trajbus.streams.worker.outbox import Sends
from trajbus.streams.worker.positions import SourcePositions
from trajbus.streams.worker.reconciliation import Reconciliation
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.state_store import AssemblyState
from trajbus.streams.worker.stats import WorkerMetrics
from trajbus.streams.worker.traces import StepTraces


class EventApplier:
    """Applies steps records to the state, each moving its partition's position past it once applied."""

    def __init__(self, settings: WorkerSettings, metrics: WorkerMetrics, state: AssemblyState,
                 positions: SourcePositions, bodies: StepBodies, emission: Emission, sends: Sends,
                 reconciliation: Reconciliation, traces: StepTraces | None) -> None:
        """``traces``: the apply spans (None unless tracing is on)."""
        self.settings, self.metrics, self.state, self.positions = settings, metrics, state, positions
        self.bodies, self.emission, self.sends = bodies, emission, sends
        self.reconciliation, self.traces = reconciliation, traces

    async def apply_at(self, channel: str, partition: int, message: Any) -> None:
        """Apply one record; the position moves past it only once it is applied. A record that fails
        half-way leaves no trace: the partition's unflushed changes and position are dropped, and it is
        reconciled again (a group being emitted may have been acknowledged)."""
        try:
            await self.process(channel, partition, message)
        except BaseException:
            self.reconciliation.forget_partition(partition)
            self.state.drop_changes(partition)
            self.positions.forget_partition(partition)
            raise
        self.positions.advance(channel, partition, message.offset)
        self.metrics.source_position.labels(channel, str(partition)).set(message.offset + 1)

    async def process(self, channel: str, partition: int, message: Any) -> None:
        """Decode, check and apply one record; what cannot be applied goes to the DLQ."""
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
        effect = group.add(event, message.offset, self.settings.channel(channel).n_rollouts)
        if effect is EventEffect.UNKNOWN_TRAJECTORY:
            await self.to_dlq(message, channel, f"unknown_trajectory: {uid} has no steps")
            return
        if effect is EventEffect.DUPLICATE:
            self.metrics.duplicates.labels(channel).inc()
            return
        group.last_offset = message.offset
        if isinstance(event, Step):
            self.bodies.put((channel, partition), message.offset, message.value)
        if not was_complete and group.is_complete(uid):
            self.metrics.trajectories.labels(channel).inc()
        if effect is EventEffect.READY:
            await self.emission.finish(partition, group, "complete")
        else:
            self.state.update_group(partition, group)

    async def to_dlq(self, message: Any, channel: str, reason: str) -> None:
        letter = DeadLetter(message.key, message.value, reason, message.topic, message.partition, message.offset,
                            message.headers)
        await self.sends.dead_letter(channel, letter)
