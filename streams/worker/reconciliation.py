"""Reconciliation: a worker that (re)gains a partition first records what an earlier owner emitted.

An owner can die, or an event can fail, between a group's acknowledgement on the groups topic and
the table's record of it. So before a partition's first event (``ensure``) the worker reads the groups
topic past the table's watermark and records each group it finds as emitted (its outcome to the ledger
first, as for any group: ``Settlement``): such a group is never emitted again. It runs once per
assignment, and again for a partition whose held changes were dropped (``forget_partition``, ``forget``):
the dropped changes may have held such a record.
"""

from __future__ import annotations

import asyncio
import logging

from trajbus.streams.worker.direct_reads import DirectReads
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.settlement import Settlement
from trajbus.streams.worker.state_store import AssemblyState
from trajbus.streams.wire.topics import groups_topic

log = logging.getLogger("trajbus.worker")


class Reconciliation:
    """The partitions reconciled since their changes were last dropped; reconciles the others on demand."""

    def __init__(self, settings: WorkerSettings, state: AssemblyState, settlement: Settlement,
                 reads: DirectReads) -> None:
        self.settings, self.state, self.settlement, self.reads = settings, state, settlement, reads
        self.prefix = settings.topics.prefix
        self.reconciled: set[int] = set()

    async def ensure(self, partition: int) -> None:
        """Record what earlier owners emitted from this partition but did not record, unless done already."""
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

    def forget_partition(self, partition: int) -> None:
        """The partition's held changes were dropped: it is reconciled again before its next event."""
        self.reconciled.discard(partition)

    def forget(self) -> None:
        """A rebalance: every partition is reconciled again."""
        self.reconciled.clear()
