"""Recovery of a worker's partitions: nothing emitted twice, nothing in lost.

- when a worker (re)gains a partition it reads the groups topic past the table's
  watermark and records what an earlier owner emitted but did not get to record:
  such groups are never emitted again, and their outcome goes to the ledger
  (``ensure_reconciled``);
- Faust's committed offsets are only where it resumes; where it resumes past the
  table's position, leaves a partition's tail undelivered after a rebalance, or
  never fetches an assigned partition (all seen with faust-streaming 0.15), the
  range is read directly and applied in order (``catch_up``, ``apply_range``);
- a partition whose event failed half-way, or a rebalance, drops the changes held since
  the last tick with the positions that cover them (``forget_partition``, ``forget``):
  those events are applied again from the saved position.

Faust's ``TableManager`` owns its ``Recovery`` the same way: a part with its own state,
given what it works on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Protocol

from trajbus.streams.worker.direct_reads import DirectReads
from trajbus.streams.worker.positions import SourcePositions
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.settlement import Settlement
from trajbus.streams.worker.state_store import AssemblyState
from trajbus.streams.worker.stats import WorkerMetrics
from trajbus.streams.wire.topics import groups_topic, steps_topic

log = logging.getLogger("trajbus.worker")

CATCH_UP_LOOKUP_TIMEOUT = 3.0
"""The catch-up's wait for the steps partitions' ends: it runs every tick, so a look-up Kafka does not
answer in this time (a broker away, a leader moving) is asked again at the next tick, not waited out."""

Apply = Callable[[str, int, Any], Awaitable[None]]
"""``apply(channel, partition, record)``: the assembler applies one steps record, its position after."""


class Recovery(Protocol):
    """What the assembler asks of recovery."""

    async def ensure_reconciled(self, partition: int) -> None: ...

    async def apply_range(self, channel: str, partition: int, start: int, end: int, why: str) -> None: ...

    async def catch_up(self) -> None: ...

    def forget_partition(self, partition: int) -> None: ...

    def forget(self) -> None: ...


class PartitionRecovery:
    """Reconciles each (re)gained partition once, and reads directly what Faust skipped or never delivered."""

    def __init__(self, settings: WorkerSettings, metrics: WorkerMetrics, state: AssemblyState,
                 positions: SourcePositions, settlement: Settlement, reads: DirectReads, apply: Apply,
                 lock: Callable[[int], asyncio.Lock], active_partitions: Callable[[], set[int]]) -> None:
        """``apply``, ``lock`` and ``active_partitions`` are the assembler's: how one record is applied, the
        lock that serialises a partition's work, and the steps partitions this worker holds."""
        self.settings, self.metrics, self.state, self.positions = settings, metrics, state, positions
        self.settlement, self.reads, self.apply = settlement, reads, apply
        self.lock, self.active_partitions = lock, active_partitions
        self.prefix = settings.topics.prefix
        self.reconciled: set[int] = set()
        self.told_direct_reads = False
        """Whether a direct read was logged since the last rebalance: one WARNING per rebalance, the rest at
        DEBUG (after a broker restart every partition has its range to read, which is the recovery working)."""

    def forget(self) -> None:
        """After a rebalance, positions, pending groups and reconciliation are re-read from the
        recovered table (changes since the last tick are dropped, with the positions that cover them:
        their events are applied again)."""
        self.reconciled.clear()
        self.state.drop_changes()
        self.positions.forget()
        self.told_direct_reads = False

    def forget_partition(self, partition: int) -> None:
        """An event of this partition failed half-way: its changes since the last tick are dropped with
        the position that covers them (its events are applied again from the saved position), and
        reconciliation runs again (a group being emitted may have been acknowledged)."""
        self.reconciled.discard(partition)
        self.state.drop_changes(partition)
        self.positions.forget_partition(partition)

    async def ensure_reconciled(self, partition: int) -> None:
        """Once per assignment: record what earlier owners emitted from this partition but did not record
        (its outcome to the ledger first, as for any group: ``Settlement``)."""
        if partition in self.reconciled:
            return
        for channel in self.settings.channels:
            found = await asyncio.to_thread(self.reads.emitted_past, groups_topic(channel, self.prefix), partition,
                                            self.state.watermark(partition, channel))
            for prompt_uid, (groups_partition, offset, source_offset) in found.items():
                if self.state.marker(partition, channel, prompt_uid) is None:
                    await self.settlement.settle(partition, channel, prompt_uid, source_offset, "emitted",
                                                 (groups_partition, offset))
                    log.info("reconciled emitted group channel=%s prompt_uid=%s", channel, prompt_uid)
                self.state.advance_watermark(partition, channel, groups_partition, offset)
        self.reconciled.add(partition)

    async def apply_range(self, channel: str, partition: int, start: int, end: int, why: str) -> None:
        """Read ``start <= offset < end`` of a steps partition directly and apply what is still new."""
        topic = steps_topic(channel, self.prefix)
        log.log(logging.DEBUG if self.told_direct_reads else logging.WARNING,
                "source offsets %d..%d of %s[%d] %s; reading them directly%s", start, end - 1, topic, partition, why,
                "" if self.told_direct_reads else " (other partitions' direct reads at DEBUG until the next rebalance)")
        self.told_direct_reads = True
        for record in await asyncio.to_thread(self.reads.read_range, topic, partition, start, end):
            if record.offset >= self.positions.expected.get((channel, partition), start):
                await self.apply(channel, partition, record)

    async def catch_up(self) -> None:
        """Apply records Faust never delivered: where a partition's log stays past our position
        and the position does not move (Faust can resume a partition at its end after a rebalance,
        or never fetch an assigned partition at all, and then nothing would reveal the skip)."""
        owned = [(channel, p) for p in sorted(self.active_partitions()) for channel in self.settings.channels]
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
            async with self.lock(partition):
                start = self.positions.known(channel, partition)
                if start is None:  # never delivered: from where the worker group resumes
                    await self.ensure_reconciled(partition)
                    start = await self.positions.start_of(channel, partition)
                if end > start:
                    await self.apply_range(channel, partition, start, end, "not delivered by the consumer")
