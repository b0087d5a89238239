"""The stream worker's parts without Kafka or Faust: a dict as its table, fakes for what it writes and reads.

``new_worker`` builds the real ``GroupAssembler`` (applier, emission, reconciliation, recovery, positions,
state) on these, so the unit tests drive the rules the integration tests prove through the broker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Iterable

from trajbus.streams.wire import codec

from trajbus.streams.client.dlq import DeadLetter
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire import ledger
from trajbus.streams.wire.dlq import REASON
from trajbus.streams.wire.headers import SOURCE_OFFSET, SOURCE_PARTITION, Headers
from trajbus.streams.wire.records import Step, TrajectoryEnd
from trajbus.streams.wire.topics import steps_topic
from trajbus.streams.worker.assembler import GroupAssembler
from trajbus.streams.worker.chores import WorkerChores
from trajbus.streams.worker.direct_reads import SourceRecord
from trajbus.streams.worker.settings import ChannelSettings, WorkerSettings
from trajbus.streams.worker.stats import WorkerMetrics

PREFIX = "p"
CHANNEL = "train"


@dataclass
class Written:
    """A record the worker wrote, as the broker would hold it."""

    key: bytes | None
    value: bytes | None
    headers: Headers = field(default_factory=list)

    def header(self, name: str) -> bytes | None:
        return dict(self.headers).get(name)


class FakeSends:
    """``outbox.Sends`` into lists; ``fail_groups`` makes the next group writes raise (a broker away)."""

    def __init__(self) -> None:
        self.groups: dict[str, list[Written]] = {}
        self.chunk_records: dict[str, list[Written]] = {}
        self.outcomes: dict[str, list[ledger.Outcome]] = {}
        self.dead_letters: list[DeadLetter] = []
        self.fail_groups = 0

    async def group(self, channel: str, key: bytes, value: bytes, headers: Headers, timestamp: float
                    ) -> tuple[int, int]:
        if self.fail_groups:
            self.fail_groups -= 1
            raise ConnectionError("the groups topic's leader is away")
        written = self.groups.setdefault(channel, [])
        written.append(Written(key, value, list(headers)))
        return 0, len(written) - 1

    async def chunks(self, channel: str, key: bytes, pieces: Iterable[bytes]) -> list[tuple[int, int]]:
        written = self.chunk_records.setdefault(channel, [])
        placed = []
        for piece in pieces:
            written.append(Written(key, bytes(piece)))
            placed.append((0, len(written) - 1))
        return placed

    async def outcome(self, channel: str, outcome: ledger.Outcome) -> None:
        self.outcomes.setdefault(channel, []).append(outcome)

    async def dead_letter(self, channel: str, letter: DeadLetter) -> None:
        self.dead_letters.append(letter)

    def chunks_topic(self, channel: str) -> str:
        return f"{PREFIX}.chunks.{channel}"

    def emitted(self, channel: str = CHANNEL) -> list[str]:
        """prompt_uids on the groups topic, in order."""
        return [w.key.decode() for w in self.groups.get(channel, [])]

    def ledger(self, channel: str = CHANNEL) -> list[tuple[str, str, str | None]]:
        return [(o.prompt_uid, o.outcome, o.reason) for o in self.outcomes.get(channel, [])]

    def reasons(self) -> list[str]:
        return [dict(letter.headers)[REASON].decode() for letter in self.dead_letters]


class FakeReads:
    """``direct_reads.DirectReads`` over in-memory logs: steps partitions and the groups topic."""

    def __init__(self, sends: FakeSends) -> None:
        self.steps: dict[tuple[str, int], list[SourceRecord]] = {}
        self.sends = sends

    def read_range(self, topic: str, partition: int, start: int, end: int) -> list[SourceRecord]:
        return [r for r in self.steps.get((topic, partition), []) if start <= r.offset < end]

    def emitted_past(self, topic: str, partition: int, marks: dict[int, int]) -> dict[str, tuple[int, int, int]]:
        channel = topic.rsplit(".", 1)[1]
        found = {}
        for offset, written in enumerate(self.sends.groups.get(channel, [])):
            if offset > marks.get(0, -1) and written.header(SOURCE_PARTITION) == str(partition).encode():
                found[written.key.decode()] = (0, offset, int(written.header(SOURCE_OFFSET)))
        return found

    def end_offsets(self, partitions: list[tuple[str, int]], timeout: float) -> dict[tuple[str, int], int]:
        return {(t, p): len(self.steps.get((t, p), [])) for t, p in partitions}


class SourceLog:
    """A steps partition the test writes to: each event gets the next offset, and the record to deliver."""

    def __init__(self, reads: FakeReads, partition: int = 0, channel: str = CHANNEL) -> None:
        self.topic, self.partition = steps_topic(channel, PREFIX), partition
        self.records = reads.steps.setdefault((self.topic, partition), [])

    def append(self, event: Step | TrajectoryEnd | bytes) -> SourceRecord:
        value = event if isinstance(event, bytes) else codec.encode(event)
        record = SourceRecord(self.topic, self.partition, len(self.records), None, value, [])
        self.records.append(record)
        return record


def step(prompt_uid: str, trajectory_uid: str, index: int = 0, last: bool = True, reward: float = 0.0) -> Step:
    return Step(prompt_ids=[1, 2], response_ids=[3, index], trajectory_uid=trajectory_uid, prompt_uid=prompt_uid,
                step_index=index, is_last=last, reward=reward)


def abandon(prompt_uid: str) -> TrajectoryEnd:
    return TrajectoryEnd(trajectory_uid=ledger.ABANDON_TRAJECTORY, prompt_uid=prompt_uid,
                         metadata={ledger.ABANDON: "the data source resumed"})


@dataclass
class Worker:
    """One assembler on fakes, with its table, writes and source logs."""

    assembler: GroupAssembler
    table: dict[bytes, bytes]
    sends: FakeSends
    reads: FakeReads
    partitions: set[int]

    def source(self, partition: int = 0) -> SourceLog:
        return SourceLog(self.reads, partition)

    def deliver(self, record: SourceRecord) -> None:
        """Faust delivers one record (``handle_once``: reconciliation, position checks, apply)."""
        asyncio.run(self.assembler.handle_once(record))

    def tick(self) -> None:
        """Flush each held partition's changes and positions (the tick's first half, without Kafka)."""
        async def flush() -> None:
            for partition in sorted(self.partitions):
                await self.assembler.reconciliation.ensure(partition)
                self.assembler.flush(partition)
        asyncio.run(flush())


def new_worker(table: dict[bytes, bytes] | None = None, sends: FakeSends | None = None,
               reads: FakeReads | None = None, partitions: Iterable[int] = (0,), **channel: object) -> Worker:
    """A worker of channel ``train`` (``n_rollouts`` 2 unless given) whose positions start at 0 where none
    is saved (as a new worker group's would)."""
    table = {} if table is None else table
    sends = sends or FakeSends()
    reads = reads or FakeReads(sends)
    settings = WorkerSettings(topics=TopicSettings(prefix=PREFIX), channels=(CHANNEL,),
                              default=ChannelSettings(**{"n_rollouts": 2, **channel}))
    held = set(partitions)
    metrics = WorkerMetrics()
    chores = WorkerChores(settings, "unused:9092", metrics)  # never started: no policy version, no Kafka
    assembler = GroupAssembler(settings, "unused:9092", table, sends, reads, metrics, chores.policy, chores.stats,
                               lambda: held, lambda: True)

    async def resume_point(channel: str, partition: int) -> int:
        return 0

    assembler.positions.resume_point = resume_point  # type: ignore[method-assign]
    return Worker(assembler, table, sends, reads, held)
