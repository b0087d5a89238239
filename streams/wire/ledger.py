"""The prompt ledger: which prompt groups a data source handed out, and how each one ended.

``{prefix}.prompts.{channel}`` is one compacted partition, so the ledger is one ordered log
that any process can fold into the same state (``LedgerView``). Three kinds of record, told
apart by their key (compaction keeps the newest value per key, so a dispatch is never
replaced by its outcome):

- ``dispatch/<prompt_uid>``: a data source handed the group out, acknowledged *before* any
  agent starts on it (dataset position, sample indices, ``n_rollouts``, channel, version);
- ``outcome/<prompt_uid>``: the stream worker emitted the group, or dropped it with its
  reason; written, acknowledged, before the worker records the group as done, and again
  by the worker's reconciliation for a group emitted but not yet recorded, so it is never missing;
- ``buffer/<id>``: a group added to slime's buffer (aborted or returned), taken by the
  dispatch that names it as its origin: the buffer needs no checkpoint.

A data source that resumes abandons what it dispatched and never saw settled: it sends an
*abandon* event (a ``TrajectoryEnd`` whose metadata holds ``ABANDON``) on the group's steps
partition. The worker, which sees that partition in order, is the one arbiter: a group it
already emitted stays emitted (the trainer gets it from the groups topic), any other is
dropped with reason ``abandoned`` (its trajectories never reach the trainer), and only then
is the prompt dispatched again, under a new ``prompt_uid``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import orjson

__all__ = ["ABANDON", "ABANDONED", "ABANDON_TRAJECTORY", "BufferEntry", "CONTENT_TYPE", "Dispatch", "LedgerError",
           "LedgerView", "Outcome", "attempt_of", "decode_record", "encode_record", "fingerprint", "next_attempt",
           "with_attempt"]

CONTENT_TYPE = "application/json; schema=trajbus.prompt-ledger; v=1"
ABANDON = "trajbus.abandon"
"""``TrajectoryEnd`` metadata key: the whole group is abandoned by its data source (the value: why)."""
ABANDON_TRAJECTORY = "*"
"""The ``trajectory_uid`` of an abandon event: it ends no trajectory, it ends the group."""
ABANDONED = "abandoned"
"""The reason the worker drops an abandoned group with."""
EMITTED, DROPPED = "emitted", "dropped"


ATTEMPT = "~"
"""A re-issue's uid is the first uid, this, and its attempt: ``<first uid>~<attempt>``."""


def attempt_of(prompt_uid: str) -> tuple[str, int]:
    """(first uid, attempt) of a prompt uid; attempt 0 for a first issue. ``ValueError`` for a bad attempt."""
    first, _, attempt = prompt_uid.partition(ATTEMPT)
    return first, int(attempt or 0)


def with_attempt(first_uid: str, attempt: int) -> str:
    """The uid of ``attempt`` of a prompt first issued as ``first_uid`` (attempt 0: ``first_uid`` itself)."""
    return f"{first_uid}{ATTEMPT}{attempt}" if attempt else first_uid


def next_attempt(prompt_uid: str) -> str:
    """The uid of the re-issue after ``prompt_uid``."""
    first, attempt = attempt_of(prompt_uid)
    return with_attempt(first, attempt + 1)


class LedgerError(ValueError):
    """A ledger record that cannot be decoded, or a ledger of another dataset."""


def fingerprint(items: Iterable[Any]) -> str:
    """A short digest of a dataset's prompts in original order: a resume against another dataset is refused."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(orjson.dumps(item, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_DATACLASS,
                                   default=str))
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Dispatch:
    """A prompt group handed out. ``origin``: the prompt_uid it re-issues, or the buffer entry it came from."""

    prompt_uid: str
    channel: str
    n_rollouts: int
    dataset: str
    """``<fingerprint>/<size>`` of the dataset the position refers to."""
    epoch: int
    offset: int
    """The prompt's position in the epoch's order (-1: not from the dataset)."""
    sample_indices: list[int]
    policy_version: int | None = None
    source: str = "dataset"
    """``dataset``, ``buffer`` or ``reissue``."""
    origin: str | None = None
    at: float = field(default_factory=time.time)

    KIND = "dispatch"

    @property
    def key(self) -> str:
        return f"{self.KIND}/{self.prompt_uid}"


@dataclass(frozen=True)
class Outcome:
    """How the worker ended a group: ``emitted``, or ``dropped`` with its ``reason``."""

    prompt_uid: str
    outcome: str
    reason: str | None = None
    placed: list[int] | None = None
    """An emitted group's [partition, offset] on the groups topic: trained once a trainer is past it."""
    at: float = field(default_factory=time.time)

    KIND = "outcome"

    @property
    def key(self) -> str:
        return f"{self.KIND}/{self.prompt_uid}"

    @classmethod
    def of(cls, prompt_uid: str, worker_outcome: str, placed: tuple[int, int] | None = None) -> "Outcome":
        """From the worker's own wording: ``emitted`` or ``dropped (<reason>)``."""
        if worker_outcome == EMITTED:
            return cls(prompt_uid, EMITTED, placed=list(placed) if placed else None)
        return cls(prompt_uid, DROPPED, worker_outcome.removeprefix("dropped (").removesuffix(")"))


@dataclass(frozen=True)
class BufferEntry:
    """A group (its samples as dicts) added to the buffer under ``entry_id``."""

    entry_id: str
    samples: list[dict[str, Any]]
    replaces: str | None = None
    """The prompt_uid of the dispatch the group was returned from (aborted): it is not issued again."""

    KIND = "buffer"

    @property
    def key(self) -> str:
        return f"{self.KIND}/{self.entry_id}"


Record = Dispatch | Outcome | BufferEntry


def encode_record(record: Record) -> tuple[bytes, bytes | None]:
    """(key, value) of a ledger record."""
    body = asdict(record)
    if isinstance(record, BufferEntry):
        body.pop("entry_id")
    return record.key.encode(), orjson.dumps({"kind": record.KIND, **body})


def decode_record(key: bytes | None, value: bytes | None) -> Record:
    """The record of one ledger message; ``LedgerError`` names what is wrong."""
    try:
        kind, _, name = (key or b"").decode().partition("/")
        if not name:
            raise LedgerError(f"ledger key {key!r} is not <kind>/<name>")
        body = orjson.loads(value) if value is not None else None
        if not isinstance(body, dict) or body.pop("kind", None) != kind:
            raise LedgerError(f"ledger value of {key!r} is not a {kind!r} record")
        if kind == Dispatch.KIND:
            record = Dispatch(**body)
            if type(record.n_rollouts) is not int or type(record.epoch) is not int or type(record.offset) is not int:
                raise LedgerError(f"ledger dispatch {name!r}: n_rollouts, epoch and offset must be integers")
            return record
        if kind == Outcome.KIND:
            return Outcome(**body)
        if kind == BufferEntry.KIND:
            return BufferEntry(name, body["samples"], body.get("replaces"))
        raise LedgerError(f"ledger key {key!r}: unknown kind {kind!r}")
    except (UnicodeDecodeError, orjson.JSONDecodeError, TypeError, KeyError) as exc:
        raise LedgerError(f"ledger record {key!r} is undecodable: {type(exc).__name__}: {exc}") from None


@dataclass
class LedgerView:
    """The ledger folded: what a data source needs to resume, and what the metrics count."""

    dispatched: dict[str, Dispatch] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    buffered: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Every buffer entry: its samples, also once taken (a re-issue of its dispatch needs them)."""
    taken: set[str] = field(default_factory=set)
    reissued: dict[str, str] = field(default_factory=dict)
    """Origin prompt_uid -> the prompt_uid that re-issued it (or the buffer entry it went back to)."""
    last_from_dataset: Dispatch | None = None
    max_sample_index: int = -1
    dataset: str | None = None

    def apply(self, record: Record) -> None:
        if isinstance(record, Outcome):
            self.outcomes[record.prompt_uid] = record
        elif isinstance(record, BufferEntry):
            self.buffered[record.entry_id] = record.samples
            if record.replaces is not None:
                self.reissued[record.replaces] = record.key
        else:
            self._dispatched(record)

    def _dispatched(self, record: Dispatch) -> None:
        self.dispatched[record.prompt_uid] = record
        self.dataset = record.dataset
        self.max_sample_index = max([self.max_sample_index, *record.sample_indices])
        if record.source == "dataset":
            self.last_from_dataset = record
        elif record.source == "buffer" and record.origin is not None:
            self.taken.add(record.origin)
        elif record.source == "reissue" and record.origin is not None:
            self.reissued[record.origin] = record.prompt_uid

    def buffer(self) -> dict[str, list[dict[str, Any]]]:
        """Buffer entries no dispatch has taken yet, in the order they were added."""
        return {entry: samples for entry, samples in self.buffered.items() if entry not in self.taken}

    def root(self, prompt_uid: str) -> Dispatch:
        """The first dispatch of the prompt a (re-)dispatch hands out: where its samples come from."""
        dispatch = self.dispatched[prompt_uid]
        while dispatch.source == "reissue" and dispatch.origin in self.dispatched:
            dispatch = self.dispatched[dispatch.origin]
        return dispatch

    def open(self) -> list[Dispatch]:
        """Dispatched and not settled by the worker, in dispatch order."""
        return [d for uid, d in self.dispatched.items() if uid not in self.outcomes]

    def due_again(self) -> list[Dispatch]:
        """Dropped as abandoned and not yet dispatched again, in dispatch order."""
        return [d for uid, d in self.dispatched.items()
                if uid not in self.reissued and self.dropped_for(uid) == ABANDONED]

    def dropped_for(self, prompt_uid: str) -> str | None:
        outcome = self.outcomes.get(prompt_uid)
        return outcome.reason if outcome is not None and outcome.outcome == DROPPED else None

    def untrained(self, positions: dict[int, int]) -> int:
        """Dispatched and not yet trained: not settled, or emitted at or past the trainer's ``positions``
        (groups partition -> offset after its last trained group). A drop settles a prompt (an
        abandoned one counts again through its re-issue)."""
        count = 0
        for uid in self.dispatched:
            outcome = self.outcomes.get(uid)
            if outcome is None:
                count += 1
            elif outcome.outcome == EMITTED and (
                    outcome.placed is None or outcome.placed[1] >= positions.get(outcome.placed[0], 0)):
                count += 1
        return count

    def check_dataset(self, dataset: str) -> None:
        """A resume against a ledger of another dataset is refused, naming both."""
        if self.dataset is not None and self.dataset != dataset:
            raise LedgerError(f"dataset: the prompt ledger was written for dataset {self.dataset} "
                              f"(fingerprint/size), this data source reads {dataset}")
