"""How a group's outcome is recorded, in one place: the prompt ledger first, then the table.

A group ends emitted or dropped. Its outcome is written to the channel's prompt ledger,
acknowledged, before the table records it (``AssemblyState.record_outcome``: the marker,
and the pending group cleared), so the ledger is never behind the table: a data source
resuming from the ledger never misses an outcome. Emission settles the groups it decides;
reconciliation settles the groups an earlier owner emitted but did not get to record.
"""

from __future__ import annotations

from trajbus.streams.wire import ledger
from trajbus.streams.worker.assembly import PendingGroup
from trajbus.streams.worker.bodies import StepBodies
from trajbus.streams.worker.outbox import Placed, Sends
from trajbus.streams.worker.state_store import AssemblyState


class Settlement:
    """Records outcomes: ledger, then table, then the group's step bodies leave memory."""

    def __init__(self, state: AssemblyState, sends: Sends, bodies: StepBodies) -> None:
        self.state, self.sends, self.bodies = state, sends, bodies

    async def settle(self, partition: int, channel: str, prompt_uid: str, source_offset: int, outcome: str,
                     placed: Placed | None = None, group: PendingGroup | None = None) -> None:
        """``outcome``: ``emitted`` (``placed``: where on the groups topic) or ``dropped (<reason>)``, decided at
        ``source_offset``; ``group``: the group as the caller holds it, else as the table has it."""
        await self.sends.outcome(channel, ledger.Outcome.of(prompt_uid, outcome, placed))
        cleared = self.state.record_outcome(partition, channel, prompt_uid, source_offset, outcome)
        held = group or cleared
        if held is not None:
            self.bodies.forget((channel, partition), held.offsets())
