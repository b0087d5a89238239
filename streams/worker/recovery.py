"""Recovery of a worker's partitions: nothing in lost, and what a rebalance leaves half-done done again.

- Faust's committed offsets are only where it resumes; where it resumes past the
  table's position, leaves a partition's tail undelivered after a rebalance, or
  never fetches an assigned partition (all seen with faust-streaming 0.15), the
  range is read directly and applied in order (``catch_up``, ``apply_range``);
- a rebalance drops the changes held since the last tick with the positions that cover
  them, and every partition is reconciled again (``forget``): those events are applied
  again from the saved position.

What an earlier owner emitted is recorded first (``streams.worker.reconciliation``); an event that
fails half-way drops its own partition's changes (``streams.worker.applier``). Recovery is given the
parts it works with, the applier and the held partitions' locks among them, as Faust's
``TableManager`` gives its ``Recovery`` what it works on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from trajbus.streams.wire.topics import steps_topic
from trajbus.streams.worker.applier import EventApplier
from trajbus.streams.worker.direct_reads import DirectReads
from trajbus.streams.worker.partitions import HeldPartitions
from trajbus.streams.worker.positions import SourcePositions
from trajbus.streams.worker.reconciliation import Reconciliation
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.state_store import AssemblyState
from trajbus.streams.worker.stats import WorkerMetrics

log = logging.getLogger("trajbus.worker")

CATCH_UP_LOOKUP_TIMEOUT = 3.0
"""The catch-up's wait for the steps partitions' ends: it runs every tick, so a look-up Kafka does not
answer in this time (a broker away, a leader moving) is asked again at the next tick, not waited out."""


class Recovery(Protocol):
    """What the assembler asks of recovery."""

    async def apply_range(self, channel: str, partition: int, start: int, end: int, why: str) -> None: ...

    async def catch_up(self) -> None: ...

    def forget(self) -> None: ...


class PartitionRecovery:
    """Reads directly what Faust skipped or never delivered, and drops what a rebalance left half-done."""

    def __init__(self, settings: WorkerSettings, metrics: WorkerMetrics, state: AssemblyState,
                 positions: SourcePositions, reconciliation: Reconciliation, reads: DirectReads,
                 applier: EventApplier, partitions: HeldPartitions) -> None:
        """``applier`` applies each record read directly; ``partitions``: the ones held, and each one's lock."""
        self.settings, self.metrics, self.state, self.positions = settings, metrics, state, positions
        self.reconciliation, self.reads, self.applier, self.partitions = reconciliation, reads, applier, partitions
        self.prefix = settings.topics.prefix
        self.told_direct_reads = False
        """Whether a direct read was logged since the last rebalance: one WARNING per rebalance, the rest at
        DEBUG (after a broker restart every partition has its range to read, which is the recovery working)."""

    def forget(self) -> None:
        """After a rebalance, positions, pending groups and reconciliation are re-read from the
        recovered table (changes since the last tick are dropped, with the positions that cover them:
        their events are applied again)."""
        self.reconciliation.forget()
        self.state.drop_changes()
        self.positions.forget()
        self.told_direct_reads = False

    async def apply_range(self, channel: str, partition: int, start: int, end: int, why: str) -> None:
        """Read ``start <= offset < end`` of a steps partition directly and apply what is still new."""
        topic = steps_topic(channel, self.prefix)
        log.log(logging.DEBUG if self.told_direct_reads else logging.WARNING,
                "source offsets %d..%d of %s[%d] %s; reading them directly%s", start, end - 1, topic, partition, why,
                "" if self.told_direct_reads else " (other partitions' direct reads at DEBUG until the next rebalance)")
        self.told_direct_reads = True
        for record in await asyncio.to_thread(self.reads.read_range, topic, partition, start, end):
            if record.offset >= self.positions.in_memory(channel, partition, start):
                await self.applier.apply_at(channel, partition, record)

    async def catch_up(self) -> None:
        """Apply records Faust never delivered: where a partition's log stays past our position
        and the position does not move (Faust can resume a partition at its end after a rebalance,
        or never fetch an assigned partition at all, and then nothing would reveal the skip)."""
        owned = [(channel, p) for p in sorted(self.partitions.active()) for channel in self.settings.channels]
        for channel, partition in owned:
            position = self.positions.known(channel, partition)
            if position is not None:  # an owned partition with nothing new still reports where it is
                self.metrics.source_position.labels(channel, str(partition)).set(position)
        if not owned:
            return
        ends = await asyncio.to_thread(self.reads.end_offsets, [(steps_topic(c, self.prefix), p) for c, p in owned],
                                       CATCH_UP_LOOKUP_TIMEOUT)
        for channel, partition in owned:
            end = ends[(steps_topic(channel, self.prefix), partition)]
            if not self.positions.stalled(channel, partition, end):
                continue
            async with self.partitions.lock(partition):
                start = self.positions.known(channel, partition)
                if start is None:  # never delivered: from where the worker group resumes
                    await self.reconciliation.ensure(partition)
                    start = await self.positions.start_of(channel, partition)
                if end > start:
                    await self.apply_range(channel, partition, start, end, "not delivered by the consumer")
