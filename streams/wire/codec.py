"""The versioned binary wire format of trajbus records (see docs/wire-format.md).

Token-id lists dominate the bytes, so they are packed at the narrowest fixed
width that holds their largest id (1, 2 or 4 bytes, little-endian): a 32k-151k
vocabulary costs 2 or 4 bytes per token instead of JSON's 6-7, and decoding is
one ``frombuffer`` call in any language. Log-probs are float32 (what engines
report). Everything else is a handful of fixed-width fields and length-prefixed
UTF-8 strings. Schema v2 stores a prompt against a prefix stored elsewhere
(``streams.wire.prefix``); v1 values still decode.
"""

from __future__ import annotations

import json
import struct
from typing import Union

import numpy as np

from trajbus.streams.wire import headers
from trajbus.streams.wire.prefix import (PROMPT_EXTENDS_SHARED, PROMPT_EXTENDS_STEP, PROMPT_FULL,
                                         StepDelta, StructuredGroup, structure)
from trajbus.streams.wire.records import ChunkedGroup, ReadyGroup, Step, TrajectoryEnd, metadata_json
from trajbus.streams.wire.versions import check_version_segments

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
MAGIC = b"TB"

KIND_STEP = 1
KIND_TRAJECTORY_END = 2
KIND_READY_GROUP = 3
KIND_CHUNKED_GROUP = 4

CONTENT_TYPES = {
    KIND_STEP: "application/vnd.trajbus.step",
    KIND_TRAJECTORY_END: "application/vnd.trajbus.trajectory-end",
    KIND_READY_GROUP: "application/vnd.trajbus.ready-group",
    KIND_CHUNKED_GROUP: "application/vnd.trajbus.chunked-group",
}

FLAG_IS_LAST = 0x01
FLAG_HAS_LOG_PROBS = 0x02
FLAG_HAS_VERSIONS = 0x04
STEP_FLAGS = FLAG_IS_LAST | FLAG_HAS_LOG_PROBS | FLAG_HAS_VERSIONS
FLAG_HAS_REWARD = 0x01

Record = Union[Step, StepDelta, TrajectoryEnd, ReadyGroup, ChunkedGroup]

_STEP_FIXED = struct.Struct("<IqdBId")  # step_index, policy_version, reward, flags, n_rollouts, created_at
_END_FIXED = struct.Struct("<BdId")  # flags, reward, n_rollouts, created_at
_GROUP_FIXED = struct.Struct("<Id")  # n_rollouts, ready_at
_PREAMBLE = struct.Struct("<2sBB")  # magic, schema version, kind
_STEP_REF = struct.Struct("<I")  # base_index
_CRC = struct.Struct("<I")  # crc32 of a chunked group's bytes
_F64 = struct.Struct("<d")  # keyframe_at
_I64 = struct.Struct("<q")  # the version of a version segment
_WIDTH_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}


class DecodeError(ValueError):
    """A value is not a trajbus record this version understands; the text says why."""


# -- writing -----------------------------------------------------------------

def _uvarint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _str(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _uvarint(len(raw)) + raw


def _ids(ids: list[int] | np.ndarray) -> bytes:
    array = np.asarray(ids)
    top = int(array.max()) if array.size else 0
    width = 1 if top < 0x100 else 2 if top < 0x10000 else 4
    return bytes((width,)) + _uvarint(array.size) + array.astype(_WIDTH_DTYPES[width]).tobytes()


def _prompt(delta: StepDelta) -> bytes:
    rest = _ids(delta.step.prompt_ids)
    if delta.kind == PROMPT_EXTENDS_STEP:
        return (bytes((PROMPT_EXTENDS_STEP,)) + _STEP_REF.pack(delta.base_index) + _uvarint(delta.prefix_len)
                + _F64.pack(delta.keyframe_at) + rest)
    if delta.kind == PROMPT_EXTENDS_SHARED:
        return bytes((PROMPT_EXTENDS_SHARED,)) + _uvarint(delta.prefix_len) + rest
    return bytes((PROMPT_FULL,)) + rest


def _version_segments(segments: list[list[int]]) -> bytes:
    return _uvarint(len(segments)) + b"".join(_uvarint(int(start)) + _I64.pack(int(version))
                                              for start, version in segments)


def _metadata(metadata: dict) -> bytes:
    raw = metadata_json(metadata) if metadata else b""
    return _uvarint(len(raw)) + raw


def _step_body(record: Step | StepDelta) -> bytes:
    delta = record if isinstance(record, StepDelta) else StepDelta(record, PROMPT_FULL, 0)
    step = delta.step
    flags = ((FLAG_IS_LAST if step.is_last else 0) | (FLAG_HAS_LOG_PROBS if step.rollout_log_probs is not None else 0)
             | (FLAG_HAS_VERSIONS if step.version_segments else 0))
    parts = [
        _str(step.trajectory_uid), _str(step.prompt_uid), _str(step.channel or ""),
        _STEP_FIXED.pack(step.step_index, step.policy_version, float(step.reward), flags,
                         step.n_rollouts or 0, float(step.created_at)),
        _prompt(delta), _ids(step.response_ids),
    ]
    if step.rollout_log_probs is not None:
        parts.append(np.asarray(step.rollout_log_probs, dtype="<f4").tobytes())
    if step.version_segments:
        parts.append(_version_segments(step.version_segments))
    parts.append(_metadata(step.metadata))
    return b"".join(parts)


def _end_body(end: TrajectoryEnd) -> bytes:
    flags = FLAG_HAS_REWARD if end.reward is not None else 0
    return b"".join([
        _str(end.trajectory_uid), _str(end.prompt_uid), _str(end.channel or ""),
        _END_FIXED.pack(flags, float(end.reward or 0.0), end.n_rollouts or 0, float(end.created_at)),
        _metadata(end.metadata),
    ])


def _group_body(group: ReadyGroup) -> bytes:
    return encode_group_body(group, *structure(group.steps))


def encode_group_body(group: ReadyGroup, shared: np.ndarray, entries: list[StepDelta]) -> bytes:
    """A group's body from its structure (``prefix.structure`` or ``prefix.regroup``); ``group.steps`` unused."""
    parts = [
        _str(group.prompt_uid), _str(group.channel), _GROUP_FIXED.pack(group.n_rollouts, float(group.ready_at)),
        _str(group.status), _metadata(group.metadata), _ids(shared), _uvarint(len(entries)),
    ]
    for entry in entries:
        body = _step_body(entry)
        parts.append(_uvarint(len(body)))
        parts.append(body)
    return b"".join(parts)


def kind_of(record: Record) -> int:
    if isinstance(record, (Step, StepDelta)):
        return KIND_STEP
    if isinstance(record, TrajectoryEnd):
        return KIND_TRAJECTORY_END
    if isinstance(record, ReadyGroup):
        return KIND_READY_GROUP
    if isinstance(record, ChunkedGroup):
        return KIND_CHUNKED_GROUP
    raise TypeError(f"not a trajbus record: {type(record).__name__}")


def encode(record: Record) -> bytes:
    """The value bytes of a record (the caller validated it); a full ``Step`` is written whole."""
    kind = kind_of(record)
    body = {KIND_STEP: _step_body, KIND_TRAJECTORY_END: _end_body, KIND_READY_GROUP: _group_body,
            KIND_CHUNKED_GROUP: _chunked_body}[kind](record)
    return preamble(kind) + body


def _chunked_body(group: ChunkedGroup) -> bytes:
    return b"".join([_str(group.prompt_uid), _str(group.topic), _uvarint(group.partition), _uvarint(group.size),
                     _CRC.pack(group.crc32), _uvarint(len(group.offsets)),
                     *(_uvarint(offset) for offset in group.offsets)])


def preamble(kind: int) -> bytes:
    return _PREAMBLE.pack(MAGIC, SCHEMA_VERSION, kind)


def headers_for(record: Record) -> headers.Headers:
    """Kafka headers that name the schema version and content type of a value."""
    return [
        (headers.SCHEMA, str(SCHEMA_VERSION).encode()),
        (headers.CONTENT_TYPE, f"{CONTENT_TYPES[kind_of(record)]}; v={SCHEMA_VERSION}".encode()),
    ]


# -- reading -----------------------------------------------------------------

class _Reader:
    __slots__ = ("buf", "pos", "arrays")

    def __init__(self, buf: bytes | memoryview, arrays: bool = False) -> None:
        self.buf = memoryview(buf)
        self.pos = 0
        self.arrays = arrays
        """Token ids and log-probs as numpy arrays over the value, not lists of Python numbers."""

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise DecodeError(f"truncated value: need {n} bytes at offset {self.pos}, have {len(self.buf) - self.pos}")
        chunk = self.buf[self.pos:end]
        self.pos = end
        return chunk

    def uvarint(self) -> int:
        value = shift = 0
        while True:
            if self.pos >= len(self.buf):
                raise DecodeError("truncated varint")
            byte = self.buf[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise DecodeError("varint longer than 64 bits")

    def str(self) -> str:
        raw = self.take(self.uvarint())
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise DecodeError(f"invalid UTF-8 in string field: {exc}") from None

    def fixed(self, layout: struct.Struct) -> tuple:
        return layout.unpack(self.take(layout.size))

    def ids(self) -> list[int] | np.ndarray:
        width = self.take(1)[0]
        dtype = _WIDTH_DTYPES.get(width)
        if dtype is None:
            raise DecodeError(f"token-id width {width} is not 1, 2 or 4")
        count = self.uvarint()
        array = np.frombuffer(self.take(count * width), dtype=dtype)
        return array if self.arrays else array.tolist()

    def floats(self, count: int) -> list[float] | np.ndarray:
        array = np.frombuffer(self.take(4 * count), dtype="<f4")
        return array if self.arrays else array.tolist()

    def version_segments(self, n_tokens: int) -> list[list[int]]:
        segments = [[self.uvarint(), self.fixed(_I64)[0]] for _ in range(self.uvarint())]
        try:
            return check_version_segments(segments, n_tokens)
        except ValueError as exc:
            raise DecodeError(str(exc)) from None

    def metadata(self) -> dict:
        text = self.str()
        if not text:
            return {}
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise DecodeError(f"metadata is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise DecodeError("metadata is not a JSON object")
        return value

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise DecodeError(f"{len(self.buf) - self.pos} trailing bytes after the record")


def _read_prompt(reader: _Reader, version: int) -> tuple[int, int, int, float]:
    """How a stored prompt starts: (form, prefix_len, base_index, keyframe_at); its own tokens follow."""
    kind = PROMPT_FULL if version == 1 else reader.take(1)[0]
    if kind == PROMPT_FULL:
        return kind, 0, 0, 0.0
    if kind == PROMPT_EXTENDS_STEP:
        (base_index,) = reader.fixed(_STEP_REF)
        prefix_len = reader.uvarint()
        (keyframe_at,) = reader.fixed(_F64)
        return kind, prefix_len, base_index, keyframe_at
    if kind == PROMPT_EXTENDS_SHARED:
        return kind, reader.uvarint(), 0, 0.0
    raise DecodeError(f"unknown prompt form {kind}")


def _read_step(reader: _Reader, version: int = SCHEMA_VERSION, in_group: bool = False) -> Step | StepDelta:
    """A Step, or a StepDelta where the prompt extends a prefix stored elsewhere (always one in a group)."""
    trajectory_uid, prompt_uid, channel = reader.str(), reader.str(), reader.str()
    step_index, policy_version, reward, flags, n_rollouts, created_at = reader.fixed(_STEP_FIXED)
    if flags & ~STEP_FLAGS:
        raise DecodeError(f"unknown step flags 0x{flags & ~STEP_FLAGS:02x}")
    kind, prefix_len, base_index, keyframe_at = _read_prompt(reader, version)
    if kind == PROMPT_EXTENDS_SHARED and not in_group:
        raise DecodeError("a step outside a group cannot extend a group's shared prompt")
    prompt_ids = reader.ids()
    response_ids = reader.ids()
    log_probs = None
    if flags & FLAG_HAS_LOG_PROBS:
        log_probs = reader.floats(len(response_ids))
    segments = reader.version_segments(len(response_ids)) if flags & FLAG_HAS_VERSIONS else None
    step = Step(
        prompt_ids=prompt_ids, response_ids=response_ids, trajectory_uid=trajectory_uid, prompt_uid=prompt_uid,
        step_index=step_index, reward=reward, policy_version=policy_version, is_last=bool(flags & FLAG_IS_LAST),
        metadata=reader.metadata(), rollout_log_probs=log_probs, created_at=created_at,
        channel=channel or None, n_rollouts=n_rollouts or None, version_segments=segments,
    )
    if kind == PROMPT_FULL and not in_group:
        return step
    return StepDelta(step, kind, prefix_len, base_index, keyframe_at)


def _read_end(reader: _Reader, version: int = SCHEMA_VERSION) -> TrajectoryEnd:
    trajectory_uid, prompt_uid, channel = reader.str(), reader.str(), reader.str()
    flags, reward, n_rollouts, created_at = reader.fixed(_END_FIXED)
    return TrajectoryEnd(
        trajectory_uid=trajectory_uid, prompt_uid=prompt_uid,
        reward=reward if flags & FLAG_HAS_REWARD else None, created_at=created_at,
        channel=channel or None, n_rollouts=n_rollouts or None, metadata=reader.metadata(),
    )


def _read_group(reader: _Reader, version: int = SCHEMA_VERSION) -> StructuredGroup:
    prompt_uid, channel = reader.str(), reader.str()
    n_rollouts, ready_at = reader.fixed(_GROUP_FIXED)
    status, metadata = reader.str(), reader.metadata()
    shared = reader.ids() if version > 1 else []
    entries = []
    for _ in range(reader.uvarint()):
        body = _Reader(reader.take(reader.uvarint()), reader.arrays)
        entries.append(_read_step(body, version, in_group=True))
        body.done()
    return StructuredGroup(shared, entries, dict(prompt_uid=prompt_uid, channel=channel, n_rollouts=n_rollouts,
                                                 ready_at=ready_at, status=status, metadata=metadata)).check()


def _read_chunked(reader: _Reader, version: int = SCHEMA_VERSION) -> ChunkedGroup:
    if version < 2:
        raise DecodeError("a chunked group needs schema version 2")
    prompt_uid, topic, partition, size = reader.str(), reader.str(), reader.uvarint(), reader.uvarint()
    (crc32,) = reader.fixed(_CRC)
    offsets = [reader.uvarint() for _ in range(reader.uvarint())]
    if not offsets:
        raise DecodeError("a chunked group names no chunks")
    return ChunkedGroup(prompt_uid, topic, partition, offsets, size, crc32)


_READERS = {KIND_STEP: _read_step, KIND_TRAJECTORY_END: _read_end, KIND_READY_GROUP: _read_group,
            KIND_CHUNKED_GROUP: _read_chunked}


def decode(value: bytes | None, arrays: bool = False, structured: bool = False) -> Record | StructuredGroup:
    """Decode a value; any defect raises ``DecodeError`` with a reason fit for the DLQ.

    ``arrays``: token ids and log-probs stay numpy arrays over ``value`` (4 bytes a token instead
    of a Python int each), for a reader that only re-encodes them; such records do not ``validate``.
    ``structured``: a group stays a ``StructuredGroup`` (its prompts not rebuilt)."""
    if not value:
        raise DecodeError("empty value")
    reader = _Reader(value, arrays)
    if len(value) < _PREAMBLE.size:
        raise DecodeError(f"value of {len(value)} bytes is shorter than the {_PREAMBLE.size}-byte preamble")
    magic, version, kind = reader.fixed(_PREAMBLE)
    if magic != MAGIC:
        raise DecodeError(f"bad magic {bytes(magic)!r}: not a trajbus record")
    if version not in READABLE_VERSIONS:
        raise DecodeError(f"schema version {version} is not supported (this reader knows {READABLE_VERSIONS})")
    read = _READERS.get(kind)
    if read is None:
        raise DecodeError(f"unknown record kind {kind}")
    try:
        record = read(reader, version)
        reader.done()
        return record if structured or not isinstance(record, StructuredGroup) else record.ready()
    except DecodeError:
        raise
    except (struct.error, ValueError, TypeError) as exc:  # PrefixError too
        raise DecodeError(f"malformed record: {exc}") from None
