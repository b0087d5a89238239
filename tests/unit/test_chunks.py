"""Chunked group records: cut to fit a record, joined only when every chunk is there and matches."""

from __future__ import annotations

import pytest

from trajbus.streams.wire import codec, headers
from trajbus.streams.wire.chunks import RECORD_OVERHEAD, fits, join, manifest, split
from trajbus.streams.wire.records import ChunkedGroup, ReadyGroup, Step

LIMIT = RECORD_OVERHEAD + 1000
"""A max.message.bytes that leaves 1,000 bytes a chunk."""


def a_group_value(tokens: int) -> bytes:
    steps = [Step(prompt_ids=list(range(tokens)), response_ids=[7] * 10, trajectory_uid=f"g/t{r}", prompt_uid="g",
                  rollout_log_probs=[-0.5] * 10) for r in range(2)]
    return codec.encode(ReadyGroup("g", "train", steps, n_rollouts=2))


def test_a_value_is_cut_into_pieces_that_each_fit_and_join_back_exactly():
    value = a_group_value(3000)
    pieces = split(value, LIMIT)
    assert not fits(value, LIMIT) and all(fits(bytes(piece), LIMIT) for piece in pieces)
    assert len(pieces) == -(-len(value) // 1000)
    offsets = [10 + 3 * i for i in range(len(pieces))]  # other records may lie between chunks
    record = manifest("g", "p.chunks.train", [(0, offset) for offset in offsets], value)
    joined = join(record, {offset: bytes(piece) for offset, piece in zip(offsets, pieces)})
    assert joined == value
    assert codec.decode(joined) == codec.decode(value)


def test_a_manifest_round_trips_through_the_codec_with_its_own_content_type():
    record = ChunkedGroup("g", "p.chunks.train", 2, [5, 6, 900], 123_456, 0xDEADBEEF)
    assert codec.decode(codec.encode(record)) == record
    assert dict(codec.headers_for(record))[headers.CONTENT_TYPE].startswith(
        b"application/vnd.trajbus.chunked-group")


def test_a_missing_or_altered_chunk_is_refused_not_decoded():
    value = a_group_value(2500)
    pieces = [bytes(piece) for piece in split(value, LIMIT)]
    record = manifest("g", "p.chunks.train", [(0, offset) for offset in range(len(pieces))], value)
    with pytest.raises(codec.DecodeError, match=r"offsets \[1\] are missing"):
        join(record, {i: piece for i, piece in enumerate(pieces) if i != 1})
    altered = dict(enumerate(pieces))
    altered[0] = b"X" + altered[0][1:]
    with pytest.raises(codec.DecodeError, match="do not match the manifest"):
        join(record, altered)


def test_chunks_on_two_partitions_are_never_named():
    with pytest.raises(RuntimeError, match=r"landed on partitions \[0, 1\]"):
        manifest("g", "p.chunks.train", [(0, 5), (1, 6)], b"xy")


def test_a_limit_with_no_room_for_a_chunk_is_an_error():
    with pytest.raises(ValueError, match="leaves no room"):
        split(b"x" * 10, RECORD_OVERHEAD)
