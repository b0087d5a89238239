"""The worker's state, typed: the one Faust table (``assembly``) behind named operations.

Every key and value of the table is built and read here, nowhere else (quix-streams keeps
get, set and encoding behind one ``State`` the same way). A key is
``{partition}|{kind}|{channel}|{prompt_uid}`` (``StateKey``): it starts with its source
partition, so writes made outside an event (timeouts) still land in that partition's
changelog partition (``faust_classes.PartitionKeyedTable`` routes each key by ``partition_of``),
and all state of a partition is ordered in one changelog partition. The kinds:

- ``g`` a pending group's step index (``PendingGroup.encode``);
- ``e`` a group's outcome marker (``Marker``): emitted or dropped, at which source offset;
- ``w`` the groups-topic watermark of a (partition, channel): groups partition -> last offset recorded;
- ``o`` the last source offset applied of a (partition, channel), as a decimal string.

These are the bytes today's changelog holds; a change to them must still read an old changelog.

Pending groups are written behind: a changed group is held here and written once a tick
(``flush``), just before the positions that cover it, so a group's index goes to the changelog
once a second, not once per event; a failed event drops its partition's held changes
(``drop_changes``) and is applied again from the saved position.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Iterator, MutableMapping

from trajbus.streams.worker.assembly import PendingGroup


class KeyKind(str, Enum):
    """What a table key holds (its one-letter code on the wire)."""

    PENDING = "g"
    MARKER = "e"
    WATERMARK = "w"
    POSITION = "o"


@dataclass(frozen=True)
class StateKey:
    """``{partition}|{kind}|{channel}|{prompt_uid}``; watermarks and positions have no prompt_uid."""

    partition: int
    kind: KeyKind
    channel: str
    prompt_uid: str = ""

    def encode(self) -> bytes:
        return f"{self.partition}|{self.kind.value}|{self.channel}|{self.prompt_uid}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> "StateKey":
        partition, kind, channel, prompt_uid = raw.decode().split("|", 3)
        return cls(int(partition), KeyKind(kind), channel, prompt_uid)


def partition_of(raw: bytes) -> int:
    """The source partition a raw table key belongs to (its changelog partition)."""
    return int(raw.split(b"|", 1)[0])


@dataclass(frozen=True)
class Marker:
    """A group's outcome: ``emitted`` or ``dropped (<reason>)``, decided at source ``offset`` at ``at``.
    An event of the group at or below ``offset`` is a replay; one above it is late."""

    offset: int
    at: float
    outcome: str

    def encode(self) -> bytes:
        return json.dumps({"offset": self.offset, "at": self.at, "outcome": self.outcome}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Marker":
        data = json.loads(raw)
        return cls(data["offset"], data["at"], data["outcome"])


KeyIndex = dict[tuple[int, KeyKind], list[StateKey]]
"""Table keys by (source partition, kind), as read by one ``index``."""


class AssemblyState:
    """The worker's table behind typed operations, with pending groups written behind (``flush``)."""

    def __init__(self, table: MutableMapping[bytes, bytes]) -> None:
        self.table = table
        self._changed: dict[int, dict[tuple[str, str], PendingGroup]] = {}
        """Per source partition, pending groups changed since the last flush, by (channel, prompt_uid)."""

    # -- pending groups ----------------------------------------------------------------------
    def group(self, partition: int, channel: str, prompt_uid: str) -> PendingGroup | None:
        """A pending group as it stands: changed since the last flush, else as the table has it."""
        changed = self._changed.get(partition, {}).get((channel, prompt_uid))
        if changed is not None:
            return changed
        stored = self.table.get(StateKey(partition, KeyKind.PENDING, channel, prompt_uid).encode())
        return None if stored is None else PendingGroup.decode(stored)

    def open_group(self, partition: int, channel: str, prompt_uid: str) -> PendingGroup:
        """The pending group as it stands, or a new empty one (not stored until ``update_group``)."""
        return self.group(partition, channel, prompt_uid) or PendingGroup(prompt_uid=prompt_uid, channel=channel)

    def update_group(self, partition: int, group: PendingGroup) -> None:
        """``group`` changed: written to the table at the partition's next ``flush``."""
        self._changed.setdefault(partition, {})[(group.channel, group.prompt_uid)] = group

    def clear_group(self, partition: int, channel: str, prompt_uid: str) -> PendingGroup | None:
        """The group leaves the table and the held changes; returns it as it stood (None: there was none)."""
        group = self.group(partition, channel, prompt_uid)
        self._changed.get(partition, {}).pop((channel, prompt_uid), None)
        self.table.pop(StateKey(partition, KeyKind.PENDING, channel, prompt_uid).encode(), None)
        return group

    def flush(self, partition: int) -> None:
        """The partition's changed groups to the table (before its positions: a saved position never
        covers an event whose group change is not in the table; the changelog keeps this order)."""
        for (channel, prompt_uid), group in self._changed.pop(partition, {}).items():
            self.table[StateKey(partition, KeyKind.PENDING, channel, prompt_uid).encode()] = group.encode()

    def drop_changes(self, partition: int | None = None) -> None:
        """Forget the held changes of one partition (an event failed half-way), or of all (a rebalance)."""
        if partition is None:
            self._changed.clear()
        else:
            self._changed.pop(partition, None)

    def has_changes(self, partition: int) -> bool:
        return bool(self._changed.get(partition))

    def pending_groups(self, partition: int, index: KeyIndex) -> Iterator[PendingGroup]:
        """The partition's pending groups as they stand now, of those ``index`` found (gone ones skipped)."""
        for key in index.get((partition, KeyKind.PENDING), []):
            group = self.group(partition, key.channel, key.prompt_uid)
            if group is not None:
                yield group

    # -- outcomes ----------------------------------------------------------------------------
    def marker(self, partition: int, channel: str, prompt_uid: str) -> Marker | None:
        raw = self.table.get(StateKey(partition, KeyKind.MARKER, channel, prompt_uid).encode())
        return None if raw is None else Marker.decode(raw)

    def record_outcome(self, partition: int, channel: str, prompt_uid: str, source_offset: int,
                       outcome: str) -> PendingGroup | None:
        """The one place a group is marked done (emitted or dropped) and its pending state cleared; returns
        the pending group as it stood (None: none was pending)."""
        marker = Marker(source_offset, time.time(), outcome)
        self.table[StateKey(partition, KeyKind.MARKER, channel, prompt_uid).encode()] = marker.encode()
        return self.clear_group(partition, channel, prompt_uid)

    def expire_markers(self, partition: int, index: KeyIndex, now: float, ttl: float) -> int:
        """Markers older than ``ttl`` seconds go (late events of their groups are then new groups); returns
        how many went."""
        expired = 0
        for key in index.get((partition, KeyKind.MARKER), []):
            raw = self.table.get(key.encode())
            if raw is not None and now - Marker.decode(raw).at > ttl:
                self.table.pop(key.encode(), None)
                expired += 1
        return expired

    # -- groups-topic watermarks ---------------------------------------------------------------
    def watermark(self, partition: int, channel: str) -> dict[int, int]:
        """Per groups partition, the last groups-topic offset whose group from this source partition is recorded."""
        raw = self.table.get(StateKey(partition, KeyKind.WATERMARK, channel).encode())
        return {int(p): offset for p, offset in json.loads(raw or b"{}").items()}

    def advance_watermark(self, partition: int, channel: str, groups_partition: int, offset: int) -> None:
        key = StateKey(partition, KeyKind.WATERMARK, channel).encode()
        marks = json.loads(self.table.get(key) or b"{}")
        if offset > marks.get(str(groups_partition), -1):
            marks[str(groups_partition)] = offset
            self.table[key] = json.dumps(marks).encode()

    # -- applied source positions ---------------------------------------------------------------
    def applied_position(self, partition: int, channel: str) -> int | None:
        """The last source offset applied (saved), or None where none was saved."""
        raw = self.table.get(StateKey(partition, KeyKind.POSITION, channel).encode())
        return None if raw is None else int(raw)

    def save_position(self, partition: int, channel: str, last_applied: int) -> None:
        """Save the last source offset applied (written only when it changed)."""
        key, value = StateKey(partition, KeyKind.POSITION, channel).encode(), str(last_applied).encode()
        if self.table.get(key) != value:
            self.table[key] = value

    # -- scans ---------------------------------------------------------------------------------
    def index(self) -> KeyIndex:
        """Every table key, decoded once, by (partition, kind)."""
        keys: KeyIndex = defaultdict(list)
        for raw in list(self.table.keys()):
            key = StateKey.decode(raw)
            keys[(key.partition, key.kind)].append(key)
        return keys
