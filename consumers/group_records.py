"""A groups-topic record as a trainer gets it: one decoding for ``BatchConsumer`` and for what reads a step's
batch back (``consumers.step_batch``), so both hand out the same rows."""

from __future__ import annotations

from trajbus.streams.client.chunks import ChunkReader
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import StructuredGroup

__all__ = ["decode_group"]


def decode_group(chunks: ChunkReader, value: bytes | None) -> StructuredGroup:
    """A groups-topic record as the trainer gets it (a chunked one read from its chunks; token ids stay
    numpy views of the value, prompts not rebuilt yet); ``ValueError`` for anything else."""
    options = {"arrays": True, "structured": True}
    record = chunks.whole(codec.decode(value, **options), **options)
    if not isinstance(record, StructuredGroup):
        raise codec.DecodeError(f"a {type(record).__name__} does not belong on a groups topic")
    return record
