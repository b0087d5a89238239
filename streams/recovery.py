"""Recovery of a worker's partitions: nothing emitted twice, nothing in lost.

- when a worker (re)gains a partition it reads the groups topic past the table's
  watermark and records what an earlier owner emitted but did not get to record:
  such groups are never emitted again (``ensure_reconciled``);
- Faust's committed offsets are only where it resumes; where it resumes past the
  table's position, leaves a partition's tail undelivered after a rebalance, or
  never fetches an assigned partition (all seen with faust-streaming 0.15), the
  range is read directly and applied in order (``catch_up``, ``apply_range``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from trajbus.infra.topics import end_offsets_of
from trajbus.streams.parts import AssemblerParts
from trajbus.streams.positions import SourcePositions
from trajbus.streams.state_keys import StateKey, emitted_past, read_range
from trajbus.streams.topics import groups_topic, steps_topic

log = logging.getLogger("trajbus.worker")

CATCH_UP_LOOKUP_TIMEOUT = 3.0
"""The catch-up's wait for the steps partitions' ends: it runs every tick, so a look-up Kafka does not
answer in this time (a broker away, a leader moving) is asked again at the next tick, not waited out."""


class PartitionRecovery(AssemblerParts):
    """The recovering half of ``streams.app.GroupAssembler``: a mixin, the assembler's parts it uses
    declared in ``AssemblerParts`` and below (and its ``lock``, ``active_partitions``, ``apply_at``,
    ``advance_watermark``, ``pending_group``, ``write_outcome``)."""

    positions: SourcePositions
    reconciled: set[int]
    told_direct_reads = False
    """Whether a direct read was logged since the last rebalance: one WARNING per rebalance, the rest at DEBUG
    (after a broker restart every partition has its range to read, which is the recovery working)."""

    def forget_positions(self) -> None:
        """After a rebalance, positions, pending groups and reconciliation are re-read from the
        recovered table (changes since the last tick are dropped, with the positions that cover them:
        their events are applied again)."""
        self.reconciled.clear()
        self.pending.clear()
        self.positions.forget()
        self.told_direct_reads = False

    def forget_partition(self, partition: int) -> None:
        """An event of this partition failed half-way: its changes since the last tick are dropped with
        the position that covers them (its events are applied again from the saved position), and
        reconciliation runs again (a group being emitted may have been acknowledged)."""
        self.reconciled.discard(partition)
        self.pending.pop(partition, None)
        self.positions.forget_partition(partition)

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
                    await self.write_outcome(channel, prompt_uid, "emitted", (groups_partition, offset))
                    self.state[marker] = json.dumps(
                        {"offset": source_offset, "at": time.time(), "outcome": "emitted"}).encode()
                    key = StateKey(partition, "g", channel, prompt_uid).encode()
                    group = self.pending_group(partition, key)  # changed since the last tick, or as stored
                    self.pending.get(partition, {}).pop(key, None)
                    self.state.pop(key, None)
                    if group is not None:
                        self.bodies.forget((channel, partition), group.offsets())
                    log.info("reconciled emitted group channel=%s prompt_uid=%s", channel, prompt_uid)
                self.advance_watermark(partition, channel, groups_partition, offset)
        self.reconciled.add(partition)

    async def apply_range(self, channel: str, partition: int, start: int, end: int, why: str) -> None:
        """Read ``start <= offset < end`` of a steps partition directly and apply what is still new."""
        topic = steps_topic(channel, self.prefix)
        log.log(logging.DEBUG if self.told_direct_reads else logging.WARNING,
                "source offsets %d..%d of %s[%d] %s; reading them directly%s", start, end - 1, topic, partition, why,
                "" if self.told_direct_reads else " (other partitions' direct reads at DEBUG until the next rebalance)")
        self.told_direct_reads = True
        for record in await asyncio.to_thread(read_range, self.bootstrap_servers, topic, partition, start, end):
            if record.offset >= self.positions.expected.get((channel, partition), start):
                await self.apply_at(channel, partition, record)

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
        ends = await asyncio.to_thread(end_offsets_of, self.bootstrap_servers,
                                       [(steps_topic(c, self.prefix), p) for c, p in owned], CATCH_UP_LOOKUP_TIMEOUT)
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
