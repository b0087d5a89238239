"""A data source's side of its prompt ledger (``pipelines.ledger``): what it hands out, named and recorded.

``Dispatcher`` names each group handed out by its ``prompt_uid`` (its dataset position, its buffer entry,
or the next attempt of an abandoned one), records it on the ledger, acknowledged, before any agent
starts on it, and keeps the buffer's groups as entries there. Built on a ledger that already holds
records, it checks the dataset is the ledger's and gives up what a crashed run left open (``Settling``
says who settles it: the stream worker by default); those groups are ``due``, handed out again first,
exactly once, under new uids. Without a ledger it names and records nothing.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from trajbus.consumers.slime.sample import Sample
from trajbus.consumers.slime.sample_kind import SampleKind
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.prompt_cursor import PromptCursor
from trajbus.streams.wire.ledger import BufferEntry, Dispatch, next_attempt

__all__ = ["Dispatcher", "Settling", "WorkerSettles"]

Picked = tuple[list[Sample], Dispatch | None]
"""A group handed out, with the dispatch that records it (None without a ledger)."""


class Settling(Protocol):
    """Who records how a group given up ended."""

    def left_open(self, ledger: PromptLedger) -> list[Dispatch]:
        """Give up the dispatches a crashed run left open; returns those to hand out again."""

    def give_up(self, ledger: PromptLedger, prompt_uids: list[str], why: str) -> None:
        """Give up these dispatches (their groups went back to the buffer)."""


class WorkerSettles:
    """The stream worker settles each group given up: dropped, unless it already emitted the group."""

    def left_open(self, ledger: PromptLedger) -> list[Dispatch]:
        return ledger.settle_open(why="data source resumed")

    def give_up(self, ledger: PromptLedger, prompt_uids: list[str], why: str) -> None:
        ledger.abandon(prompt_uids, why)


class Dispatcher:
    """The ``ledger`` (None: nothing recorded) of a data source over ``dataset_id``."""

    def __init__(self, ledger: PromptLedger | None, dataset_id: str, kind: SampleKind,
                 settling: Settling | None = None) -> None:
        self.ledger, self.dataset_id, self.kind = ledger, dataset_id, kind
        self.settling: Settling = settling or WorkerSettles()
        self.due: list[Dispatch] = []
        """Dispatches abandoned at the resume, handed out again before anything else."""
        if ledger is not None:
            ledger.provision()
            ledger.refresh()
            ledger.view.check_dataset(dataset_id)
            self.due = self.settling.left_open(ledger)

    def stamp(self, group: list[Sample], source: str, epoch: int, offset: int, origin: str | None = None) -> Picked:
        """A group and the dispatch that will record it; its samples carry the new prompt_uid."""
        if self.ledger is None:
            return group, None
        if source == "reissue":
            prompt_uid = next_attempt(origin)
        elif source == "buffer":
            prompt_uid = f"b{origin or uuid.uuid4().hex[:16]}"
        else:  # a dataset position names the prompt; without a dataset, its first sample does
            prompt_uid = f"p{self.dataset_id[:8]}-e{epoch}-o{offset}" if offset >= 0 else f"s{group[0].index}"
        for sample in group:
            sample.prompt_uid = prompt_uid
        return group, Dispatch(prompt_uid, self.ledger.channel, len(group), self.dataset_id, epoch, offset,
                               [s.index for s in group], self.ledger.policy_version(), source, origin)

    def again(self, num_samples: int, cursor: PromptCursor) -> list[Picked]:
        """Up to ``num_samples`` of the ``due`` groups, rebuilt as first handed out, as re-issues."""
        taken, self.due = self.due[:num_samples], self.due[num_samples:]
        picked = []
        for dispatch in taken:
            root = self.ledger.view.root(dispatch.prompt_uid)
            if root.source == "buffer":
                group = [self.kind.restore(s) for s in self.ledger.view.buffered[root.origin]]
            else:
                group = cursor.regroup(root.epoch, root.offset, root.sample_indices)
            picked.append(self.stamp(group, "reissue", root.epoch, root.offset, dispatch.prompt_uid))
        return picked

    def record(self, dispatches: list[Dispatch | None]) -> None:
        """Every group handed out is on the ledger, acknowledged, before any agent starts on it."""
        if self.ledger is not None and dispatches:
            self.ledger.write(dispatches)

    def buffered(self, groups: list[list[Any]]) -> list[str | None]:
        """Groups going to the buffer, recorded as its entries; returns each one's entry (None without a
        ledger). A group returned from a dispatch replaces it: that dispatch is given up."""
        if self.ledger is None:
            return [None] * len(groups)
        entries = [BufferEntry(uuid.uuid4().hex[:16], [self.kind.record(s) for s in group],
                               getattr(group[0], "prompt_uid", None) if group else None) for group in groups]
        self.ledger.write(entries)
        self.give_up([entry.replaces for entry in entries if entry.replaces], "returned to the buffer")
        return [entry.entry_id for entry in entries]

    def give_up(self, prompt_uids: list[str], why: str) -> None:
        """Dispatches whose groups went back to the buffer, given up as ``settling`` does it."""
        if prompt_uids:
            self.settling.give_up(self.ledger, prompt_uids, why)
