"""Group records larger than one Kafka record: written as chunks, named by a manifest.

Prefix sharing keeps most groups far below the topics' ``max.message.bytes`` (16 MiB),
but 16 rollouts x 100 turns of 128k-token contexts still outgrow it. Such a group's
value (exactly the bytes of a ``ReadyGroup`` record) is cut into chunks on
``{prefix}.chunks.{channel}``; once every chunk is acknowledged, a ``ChunkedGroup``
manifest takes the group's place on the groups topic. The groups topic thus still
holds one record per group, in readiness order: commits, checkpoints, the queue
bound, the worker's recovery and replay all work on it unchanged, and a writer that
dies between chunks leaves only chunks that no manifest names, which retention
deletes. A reader fetches the chunks a manifest names by offset and checks their
size and CRC-32 before decoding the joined bytes (``join``).

This is the framing only; the Kafka reads and writes of chunks are ``streams.client.chunks``.
"""

from __future__ import annotations

import zlib
from typing import Mapping

from trajbus.streams.wire import codec
from trajbus.streams.wire.records import ChunkedGroup

RECORD_OVERHEAD = 64 * 1024
"""Bytes a record may need beyond its value (key, headers, batch framing), with a wide margin."""


def fits(value: bytes, max_message_bytes: int) -> bool:
    """Whether ``value`` goes in one record of a topic with this ``max.message.bytes``."""
    return len(value) + RECORD_OVERHEAD <= max_message_bytes


def split(value: bytes, max_message_bytes: int) -> list[memoryview]:
    """``value`` in pieces that each fit one record (views: nothing is copied)."""
    size = max_message_bytes - RECORD_OVERHEAD
    if size <= 0:
        raise ValueError(f"max_message_bytes: {max_message_bytes} leaves no room for a chunk")
    view = memoryview(value)
    return [view[start:start + size] for start in range(0, len(value), size)]


def manifest(prompt_uid: str, topic: str, written: list[tuple[int, int]], value: bytes) -> ChunkedGroup:
    """The record naming ``value``'s chunks, acknowledged in order at (partition, offset) ``written``
    of ``topic``; they share the group's key, hence one partition."""
    partitions = {partition for partition, _ in written}
    if len(partitions) != 1:
        raise RuntimeError(f"chunks of group {prompt_uid} landed on partitions {sorted(partitions)}")
    return ChunkedGroup(prompt_uid, topic, partitions.pop(), [offset for _, offset in written], len(value),
                        zlib.crc32(value))


def join(group: ChunkedGroup, chunks: Mapping[int, bytes]) -> bytes:
    """The group's value from its chunks by offset; ``DecodeError`` if one is missing or they do not match."""
    missing = [offset for offset in group.offsets if offset not in chunks]
    if missing:
        raise codec.DecodeError(f"chunked group {group.prompt_uid}: chunks at {group.topic}[{group.partition}] "
                                f"offsets {missing} are missing")
    value = b"".join(chunks[offset] for offset in group.offsets)
    if len(value) != group.size or zlib.crc32(value) != group.crc32:
        raise codec.DecodeError(f"chunked group {group.prompt_uid}: its chunks do not match the manifest "
                                f"({len(value)} bytes, {group.size} named)")
    return value
