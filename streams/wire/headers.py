"""Every Kafka header trajbus writes, by name, and the encodings of those with structure.

A value describes itself (its preamble, ``streams.wire.codec``); headers let a tool route records
without decoding them, carry trace context, and tell the stream workers where an emitted group came
from, so that each group is emitted once across crashes. The dead-letter headers are in
``streams.wire.dlq``.
"""

from __future__ import annotations

from typing import Mapping

import orjson

Headers = list[tuple[str, bytes]]

SCHEMA = "trajbus-schema-version"
"""Every trajbus value: its schema version, decimal ASCII (``codec.headers_for``)."""
CONTENT_TYPE = "content-type"
"""Every value: what it holds (``codec.CONTENT_TYPES``; a JSON record's ``CONTENT_TYPE`` of its module)."""
TRACEPARENT = "traceparent"
"""A record sent inside a span (tracing on): its W3C trace context. The name is W3C's; ``infra.tracing``,
below the wire, writes it under the same name (tests/unit/test_wire_only.py checks they agree)."""
SOURCE_PARTITION = "trajbus-source-partition"
"""A group record: the steps-topic partition of its events, decimal ASCII."""
SOURCE_OFFSET = "trajbus-source-offset"
"""A group record: the offset of the last event applied to it, decimal ASCII."""
GROUP_TRACEPARENTS = "trajbus-traceparents"
"""A group record, tracing on: JSON ``{trajectory_uid: traceparent}`` of the worker's emit span of each."""
REPLAYED_FROM = "trajbus-replayed-from"
"""A group record ``trajbus replay`` copied into another channel: the groups topic it was read from."""


def content_type_headers(content_type: str) -> Headers:
    """The headers of a JSON record (prompt ledger, trained log, policy version) of this content type."""
    return [(CONTENT_TYPE, content_type.encode())]


def source_headers(partition: int, offset: int) -> Headers:
    """Where an emitted group came from: its source partition and the offset of its last event."""
    return [(SOURCE_PARTITION, str(partition).encode()), (SOURCE_OFFSET, str(offset).encode())]


def source_of(headers: Mapping[str, bytes]) -> tuple[int, int] | None:
    """(source partition, offset of the last event) a group record names; None if it names none or names them
    unreadably (a record another writer put there is not the worker's)."""
    partition, offset = headers.get(SOURCE_PARTITION), headers.get(SOURCE_OFFSET)
    if partition is None or offset is None:
        return None
    try:
        return int(partition), int(offset)
    except ValueError:
        return None


def encode_traceparents(parents: Mapping[str, str | None]) -> bytes:
    """The ``trajbus-traceparents`` value: trajectory uid -> traceparent."""
    return orjson.dumps(dict(parents))


def decode_traceparents(value: bytes | str | None) -> dict[str, str]:
    """Trajectory uid -> traceparent a ``trajbus-traceparents`` value names; {} when absent or malformed
    (a trace is a convenience: a bad header never stops a reader)."""
    if not value:
        return {}
    try:
        parents = orjson.loads(value)
    except orjson.JSONDecodeError:
        return {}
    return parents if isinstance(parents, dict) else {}
