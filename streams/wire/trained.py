"""The trained log: which prompt groups each trainer step trained, so a run can be audited and a step's
batch replayed.

``{prefix}.trained.{channel}`` is one partition, kept as long as the cluster keeps it (no retention by age
or size), key = the run. A trainer writes one record per step, acknowledged, once the step's groups are
handed to its update and before a checkpoint that includes the step can be saved
(``pipelines.training_state``): a checkpoint never exists without its batches on record.

A record names each group by its place on the groups topic (partition, offset) and by its ``prompt_uid``:
offsets address a step on this cluster, the ``prompt_uid`` (the group record's key) on a copy of the topics
elsewhere, where offsets differ. ``positions`` is where the trainer stood after the step (groups partition ->
offset after its last group handed out): a group behind it that no step trained was skipped.

A trainer that resumes from a checkpoint trains its steps again from the checkpoint's step on: a record of
step N supersedes every earlier record of the same run and rank whose step is N or later (those updates were
lost with the process). ``effective_steps`` folds the log by that rule into the history the model has seen.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import orjson

__all__ = ["CONTENT_TYPE", "GroupRef", "TrainedLogError", "TrainedStep", "decode_trained", "effective_steps",
           "encode_trained"]

CONTENT_TYPE = "application/json; schema=trajbus.trained-step; v=1"


class TrainedLogError(ValueError):
    """A trained-log record that cannot be decoded; the message names what is wrong."""


@dataclass(frozen=True)
class GroupRef:
    """One group a step trained: where it is on the groups topic, and its key (portable across clusters).
    Partition and offset -1: a group the trainer generated itself (slime's own rollouts), by key only."""

    partition: int
    offset: int
    prompt_uid: str


@dataclass(frozen=True)
class TrainedStep:
    """One trainer step: the groups it trained, in the order the trainer got them."""

    run: str
    step: int
    topic: str
    """The groups topic the offsets refer to."""
    groups: list[GroupRef]
    positions: dict[int, int]
    """The trainer's position after the step: groups partition -> offset after its last group handed out."""
    trainer: str = "batch_consumer"
    """Which reader handed the groups out: ``batch_consumer``, ``verl``, ``slime``."""
    policy_version: int | None = None
    """The policy the step's update started from (what the groups were trained against)."""
    rank: int = 0
    at: float = field(default_factory=time.time)


def encode_trained(record: TrainedStep) -> tuple[bytes, bytes]:
    """(key, value) of a trained-log record."""
    body = asdict(record)
    body["groups"] = [[g.partition, g.offset, g.prompt_uid] for g in record.groups]
    body["positions"] = {str(p): o for p, o in record.positions.items()}
    return record.run.encode(), orjson.dumps(body)


def decode_trained(value: bytes | None) -> TrainedStep:
    """The record of one trained-log message; ``TrainedLogError`` names what is wrong."""
    try:
        body: dict[str, Any] = orjson.loads(value or b"")
        groups = [GroupRef(int(p), int(o), str(uid)) for p, o, uid in body.pop("groups")]
        positions = {int(p): int(o) for p, o in body.pop("positions").items()}
        record = TrainedStep(groups=groups, positions=positions, **body)
    except (orjson.JSONDecodeError, TypeError, ValueError, KeyError, AttributeError) as exc:
        raise TrainedLogError(f"trained-log record is undecodable: {type(exc).__name__}: {exc}") from None
    if type(record.step) is not int or not isinstance(record.run, str):
        raise TrainedLogError(f"trained-log record: step must be an integer and run a string, got "
                              f"{record.step!r}, {record.run!r}")
    return record


def effective_steps(records: Iterable[TrainedStep]) -> list[TrainedStep]:
    """The steps the runs' models have seen, by run, step and rank: a record of step N of a (run, rank) supersedes
    that run and rank's earlier records of step N or later (a resume from an earlier checkpoint)."""
    history: dict[tuple[str, int], list[TrainedStep]] = {}
    for record in records:
        steps = history.setdefault((record.run, record.rank), [])
        steps[:] = [kept for kept in steps if kept.step < record.step]
        steps.append(record)
    return sorted((s for steps in history.values() for s in steps), key=lambda s: (s.run, s.step, s.rank))
