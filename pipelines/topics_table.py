"""The table of ``trajbus topics``: by default what a person checks, in 120 columns; ``--wide`` adds the rest.

Each partition's end offset and the raw ``key=value`` configs made lines 200 columns wide, so the default
table says what the configs mean for the data instead (how it is cleaned up, how long it is kept, how
big a record may be) in words of a few characters; ``--wide`` adds both, exact, for a script or a ticket.
A config the topic does not set is ``-``: the cluster's default applies.
"""

from __future__ import annotations

from typing import Sequence

from trajbus.infra.topics import TopicInfo

__all__ = ["COLUMNS", "WIDE_COLUMNS", "rows", "duration", "size"]

COLUMNS = ["topic", "partitions", "records", "cleanup", "retention", "max message"]
WIDE_COLUMNS = [*COLUMNS, "end offsets", "configs"]
UNSET = "-"

_TIME_UNITS = (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1_000), ("ms", 1))
_SIZE_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def _largest_exact(value: int, units: Sequence[tuple[str, int]]) -> str:
    """``value`` in the largest unit that divides it (so nothing is rounded away)."""
    name, scale = next((name, scale) for name, scale in units if value % scale == 0)
    return f"{value // scale} {name}"


def duration(ms: str) -> str:
    """A ``*.ms`` config for a reader: 604800000 -> 7 d, -1 -> forever."""
    value = int(ms)
    return "forever" if value < 0 else _largest_exact(value, _TIME_UNITS)


def size(count: str) -> str:
    """A ``*.bytes`` config for a reader: 16777216 -> 16 MiB, -1 -> unlimited."""
    value = int(count)
    return "unlimited" if value < 0 else _largest_exact(value, _SIZE_UNITS)


def _retention(config: dict[str, str]) -> str:
    """How long, and up to how much, the log is kept: Kafka deletes a segment past either limit."""
    limits = [describe(config[key]) for key, describe in (("retention.ms", duration), ("retention.bytes", size))
              if key in config]
    return " / ".join(limits) or UNSET


def rows(infos: list[TopicInfo], wide: bool = False) -> list[list[object]]:
    """One row per topic, in ``WIDE_COLUMNS`` order with ``wide``, else in ``COLUMNS`` order."""
    table: list[list[object]] = []
    for info in infos:
        config = info.config
        row: list[object] = [info.name, info.partitions, info.records, config.get("cleanup.policy", UNSET),
                             _retention(config),
                             size(config["max.message.bytes"]) if "max.message.bytes" in config else UNSET]
        if wide:
            row += [",".join(map(str, info.end_offsets)), " ".join(f"{k}={v}" for k, v in sorted(config.items()))]
        table.append(row)
    return table
