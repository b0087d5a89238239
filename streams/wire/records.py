"""The records that flow through trajbus, and what makes each one valid.

``Step``          one LLM call of one trajectory, token-exact (steps topics)
``TrajectoryEnd`` marks a trajectory complete, optionally with its reward (steps topics)
``ReadyGroup``    every step of every trajectory of one prompt group (groups topics)

Validation lives here, with the records, so that every entry point (the Python
producer, the gateway, replay) refuses the same bad input with the same message:
a ``ValueError`` whose text starts with the offending field's name. A constructor
call without a required field is Python's ``TypeError`` for a call, in the words
``from_dict`` uses (``prompt_uid: required field is missing``).
"""

from __future__ import annotations

import json
import math
import time
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, NoReturn

import numpy as np
import orjson

from trajbus.streams.wire.topics import validate_channel
from trajbus.streams.wire.versions import check_version_segments

_U32 = 2**32
_I64 = 2**63
CREATED_AT_LIMIT = _I64 // 1000
"""``created_at`` (Unix seconds) becomes the Kafka record's timestamp, int64 milliseconds: it must stay below this."""

SEGMENT_START = "segment_start"
"""Step metadata key: true when the step's prompt does not extend its trajectory's previous context
(the agent edited or restarted its history, or the step is an extra choice of an ``n > 1`` call)."""
CONTINUES = "continues"
"""Step metadata key: the step_index whose prompt + response this step's prompt extends, when that is
not ``step_index - 1`` (e.g. after the extra choices of an ``n > 1`` call)."""
END_STEPS = "steps"
"""TrajectoryEnd metadata key: the step indices that make up the trajectory, exactly. A step of the
trajectory not named is left out of its group (e.g. one the gateway sent but never saw acknowledged),
and no index outside the list is waited for."""


def _check_str(name: str, value: object) -> str:
    """A non-empty string that UTF-8 can carry (a lone surrogate would fail only when the record is encoded)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: must be a non-empty string, got {value!r}")
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ValueError(f"{name}: must be valid Unicode (a lone surrogate is not), got {value!r}") from None
    return value


def _check_int(name: str, value: object, low: int = 0, high: int = _U32) -> int:
    if type(value) is not int or not low <= value < high:  # bool is not an int here
        raise ValueError(f"{name}: must be an integer in [{low}, {high}), got {value!r}")
    return value


def _finite(value: object) -> float | None:
    """``value`` as a finite float, else None (a bool is no number here; an int past a float's range is none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _check_float(name: str, value: object) -> float:
    number = _finite(value)
    if number is None:
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    return number


def _check_created_at(value: object) -> float:
    """Unix seconds that fit the record's timestamp (``CREATED_AT_LIMIT``); the gateway's rule too."""
    number = _finite(value)
    if number is None or not 0 <= number < CREATED_AT_LIMIT:
        raise ValueError(f"created_at: must be Unix seconds in [0, {CREATED_AT_LIMIT}), got {value!r}")
    return number


def _check_token_ids(name: str, ids: object, start: int = 0, non_empty: bool = False) -> None:
    """``ids[start:]`` are token ids (those before ``start`` were checked already). An ``array('I')`` (how the
    gateway holds a context) holds nothing else."""
    if not isinstance(ids, (list, tuple)) and not (isinstance(ids, array) and ids.typecode == "I"):
        raise ValueError(f"{name}: must be a list of token ids, got {type(ids).__name__}")
    if non_empty and not ids:
        raise ValueError(f"{name}: must hold at least one token id (a step is one call's sampled response), "
                         f"got {ids!r}")
    if isinstance(ids, array):
        return
    new = ids[start:] if start else ids
    if not new or (set(map(type, new)) == {int} and min(new) >= 0 and max(new) < _U32):
        return  # the common case at C speed
    for position, token in enumerate(new, start):
        if type(token) is not int or not 0 <= token < _U32:
            raise ValueError(f"{name}[{position}]: token ids are integers in [0, 2**32), got {token!r}")


def _log_prob(value: object) -> bool:
    """A number a float holds; -inf is one (a token the engine held impossible), NaN is not."""
    return not math.isnan(value) if isinstance(value, float) else _finite(value) is not None


def _check_log_probs(values: object, n_tokens: int) -> None:
    """One number per response token. An ``array('d')`` (how the gateway hands over an engine's) holds only floats,
    so only NaN is looked for, in one numpy pass."""
    packed = isinstance(values, array) and values.typecode == "d"
    if not packed and not isinstance(values, (list, tuple)):
        raise ValueError("rollout_log_probs: must be a list of floats or null")
    if len(values) != n_tokens:
        raise ValueError(f"rollout_log_probs: has {len(values)} values for {n_tokens} response tokens "
                         f"(need one per token)")
    if packed:
        if not np.isnan(np.frombuffer(values, dtype=np.float64)).any():
            return
    elif set(map(type, values)) <= {float} and not any(map(math.isnan, values)):
        return  # the common case at C speed
    for position, value in enumerate(values):
        if not _log_prob(value):
            raise ValueError(f"rollout_log_probs[{position}]: must be a number, got {value!r}")


def _non_string_keys(value: object) -> list:
    """The dict keys (at any depth) that are not strings."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found += [key for key in item if not isinstance(key, str)]
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


_PLAIN_JSON = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
"""orjson's options that leave to the standard library's ``json`` what it would not write as plain JSON."""


def metadata_json(metadata: dict) -> bytes:
    """Metadata as compact UTF-8 JSON: by orjson (a step's metadata on every call, about 4x faster), else by the
    standard library (an integer past 64 bits, a subclass of a JSON type), which writes what it always wrote."""
    try:
        return orjson.dumps(metadata, option=_PLAIN_JSON)
    except orjson.JSONEncodeError:
        return json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode()


def _check_metadata(name: str, metadata: object) -> dict:
    """A dict that goes on the wire as UTF-8 JSON and comes back equal (lists for tuples): JSON values, string
    keys (JSON would turn ``1`` into ``"1"``, and ``{1: .., "1": ..}`` into one key), no lone surrogate.
    Metadata of plain JSON values that orjson gives back equal passes at once (no NaN does: NaN is unequal to
    itself); any other is checked by the standard library, which names what is wrong."""
    if not isinstance(metadata, dict):
        raise ValueError(f"{name}: must be a dict, got {type(metadata).__name__}")
    try:
        if orjson.loads(orjson.dumps(metadata, option=_PLAIN_JSON)) == metadata:
            return metadata
    except orjson.JSONEncodeError:
        pass
    try:
        text = json.dumps(metadata, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{name}: must be JSON-serialisable ({exc})") from None
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{name}: strings must be valid Unicode (a lone surrogate is not)") from None
    if json.loads(text) != metadata:  # at C speed; only a tuple or a key that is no string differs
        keys = _non_string_keys(metadata)
        if keys:
            raise ValueError(f"{name}: keys must be strings (JSON object keys), got {keys[0]!r}")
    return metadata


def validate_metadata(metadata: object) -> dict:
    """Metadata of any record (the gateway's rule too): a dict that JSON carries and gives back, as UTF-8."""
    return _check_metadata("metadata", metadata)


def _check_step_list(value: object) -> list[int]:
    name = f"metadata.{END_STEPS}"
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name}: must be a non-empty list of step indices, got {value!r}")
    for index in value:
        _check_int(name, index)
    if len(set(value)) != len(value):
        raise ValueError(f"{name}: step indices must be distinct, got {value!r}")
    return value


def _check_n_rollouts(value: object) -> int | None:
    if value is None:
        return None
    return _check_int("n_rollouts", value, low=1)


def _from_mapping(cls: type, data: Mapping[str, Any], required: tuple[str, ...]) -> Any:
    """Build a record from a dict (JSON bodies): missing or unknown fields are named."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    for name in required:
        if name not in data:
            raise ValueError(f"{name}: required field is missing")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field of {cls.__name__}")
    record = cls(**data)
    record.validate()
    return record


class _Missing:
    """The default of a field a record cannot go without, so that its constructor can name the field when
    it is missing (a dataclass's own message is an argument count). Checked by identity, ~0.1 us a record
    (a wrapped ``__init__`` that named the field from the ``TypeError`` cost ~0.8 us)."""

    def __repr__(self) -> str:
        return "<required>"


_MISSING: Any = _Missing()


def _name_missing(record: Any) -> NoReturn:
    name = next(name for name in record.REQUIRED if getattr(record, name) is _MISSING)
    raise TypeError(f"{name}: required field is missing")


@dataclass
class Step:
    """One LLM call: the exact prompt and response token ids, and where it belongs."""

    prompt_ids: list[int] = _MISSING
    response_ids: list[int] = _MISSING
    trajectory_uid: str = _MISSING
    prompt_uid: str = _MISSING
    step_index: int = 0
    reward: float = 0.0
    policy_version: int = 0
    is_last: bool = False
    metadata: dict = field(default_factory=dict)
    rollout_log_probs: list[float] | None = None
    """One log-probability per response token, as the inference engine sampled it."""
    created_at: float = field(default_factory=time.time)
    """Unix time in seconds when the step was created."""
    channel: str | None = None
    """Set by the producer from the topic's channel; a mismatch is refused."""
    n_rollouts: int | None = None
    """The expected group size, when the submitter registers it; else the channel default."""
    version_segments: list[list[int]] | None = None
    """``[[start, version], ...]``: the response token where each run sampled by one policy version begins,
    when a weight update cut the generation (``streams.wire.versions``); None: every token is ``policy_version``'s."""

    REQUIRED = ("prompt_ids", "response_ids", "trajectory_uid", "prompt_uid")

    def __post_init__(self) -> None:
        if self.prompt_ids is _MISSING or self.response_ids is _MISSING or self.trajectory_uid is _MISSING or \
                self.prompt_uid is _MISSING:
            _name_missing(self)

    def validate(self, known_prefix: int = 0) -> "Step":
        """Raises ``ValueError`` naming the first bad field. ``known_prefix``: leading prompt tokens
        already checked (a producer's last step of the trajectory), so a turn costs its new tokens."""
        _check_token_ids("prompt_ids", self.prompt_ids, known_prefix)
        _check_token_ids("response_ids", self.response_ids, non_empty=True)
        _check_str("trajectory_uid", self.trajectory_uid)
        _check_str("prompt_uid", self.prompt_uid)
        _check_int("step_index", self.step_index)
        _check_float("reward", self.reward)
        _check_int("policy_version", self.policy_version, low=-_I64, high=_I64)
        if not isinstance(self.is_last, bool):
            raise ValueError(f"is_last: must be a boolean, got {self.is_last!r}")
        _check_metadata("metadata", self.metadata)
        if self.rollout_log_probs is not None:
            _check_log_probs(self.rollout_log_probs, len(self.response_ids))
        _check_created_at(self.created_at)
        if self.channel is not None:
            validate_channel(self.channel)
        _check_n_rollouts(self.n_rollouts)
        if self.version_segments is not None:
            self.version_segments = check_version_segments(self.version_segments, len(self.response_ids))
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Step":
        return _from_mapping(cls, data, cls.REQUIRED)

    @property
    def key(self) -> tuple[str, int]:
        """Identity of a step: a redelivered step has the same key."""
        return (self.trajectory_uid, self.step_index)


@dataclass
class TrajectoryEnd:
    """Marks a trajectory complete; a given ``reward`` lands on its last step."""

    trajectory_uid: str = _MISSING
    prompt_uid: str = _MISSING
    reward: float | None = None
    created_at: float = field(default_factory=time.time)
    channel: str | None = None
    n_rollouts: int | None = None
    metadata: dict = field(default_factory=dict)

    REQUIRED = ("trajectory_uid", "prompt_uid")

    def __post_init__(self) -> None:
        if self.trajectory_uid is _MISSING or self.prompt_uid is _MISSING:
            _name_missing(self)

    def validate(self) -> "TrajectoryEnd":
        _check_str("trajectory_uid", self.trajectory_uid)
        _check_str("prompt_uid", self.prompt_uid)
        if self.reward is not None:
            _check_float("reward", self.reward)
        _check_created_at(self.created_at)
        if self.channel is not None:
            validate_channel(self.channel)
        _check_n_rollouts(self.n_rollouts)
        _check_metadata("metadata", self.metadata)
        if END_STEPS in self.metadata:
            _check_step_list(self.metadata[END_STEPS])
        return self

    @property
    def steps(self) -> list[int] | None:
        """The step indices the trajectory consists of, when the end names them."""
        return self.metadata.get(END_STEPS)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrajectoryEnd":
        return _from_mapping(cls, data, cls.REQUIRED)


@dataclass
class ReadyGroup:
    """A prompt group ready for training: its steps ordered by (trajectory_uid, step_index)."""

    prompt_uid: str
    channel: str
    steps: list[Step]
    n_rollouts: int
    ready_at: float = field(default_factory=time.time)
    status: str = "complete"
    """``complete``, or ``partial`` when emitted after a timeout with fewer trajectories."""
    metadata: dict = field(default_factory=dict)

    @property
    def trajectory_uids(self) -> list[str]:
        return sorted({step.trajectory_uid for step in self.steps})


@dataclass
class ChunkedGroup:
    """A group record too large for one Kafka record, on the groups topic in its place: its bytes
    (exactly a ``ReadyGroup`` value) lie in chunks at ``offsets`` of ``topic[partition]``, in order
    (``streams.wire.chunks``)."""

    prompt_uid: str
    topic: str
    partition: int
    offsets: list[int]
    size: int
    crc32: int
    """CRC-32 of the joined bytes: a reader checks it before decoding them."""
