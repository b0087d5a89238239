"""The worker's own source positions: what it trusts, and what it asks Kafka for."""

from __future__ import annotations

import asyncio

import pytest

from trajbus.infra import retry
from trajbus.streams.worker import positions as positions_module
from trajbus.streams.worker.positions import SourcePositions
from trajbus.streams.worker.state_store import AssemblyState
from tests.unit.worker_fakes import new_worker, step


def new_positions(table: dict[bytes, bytes], answers: list[object], deadline: float = 30.0) -> SourcePositions:
    """Positions whose resume-point look-up answers ``answers`` in turn (an exception is raised)."""
    positions = SourcePositions(AssemblyState(table), "unused:9092", "worker-group", "p", deadline)

    async def resume_point(channel: str, partition: int) -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    positions.resume_point = resume_point  # type: ignore[method-assign]
    return positions


def test_a_saved_position_is_trusted_without_asking_kafka() -> None:
    table: dict[bytes, bytes] = {}
    AssemblyState(table).save_position(3, "train", 41)
    positions = new_positions(table, [])
    assert positions.known("train", 3) == 42
    assert asyncio.run(positions.start_of("train", 3)) == 42


def test_with_no_saved_position_the_group_resume_point_is_asked_through_an_outage(monkeypatch) -> None:
    monkeypatch.setattr(retry, "FIRST_WAIT", 0.0)
    positions = new_positions({}, [RuntimeError("all brokers down"), RuntimeError("all brokers down"), 7])
    assert asyncio.run(positions.start_of("train", 0)) == 7
    assert positions.known("train", 0) == 7


def test_an_unanswered_resume_point_fails_past_the_deadline_instead_of_guessing() -> None:
    positions = new_positions({}, [RuntimeError("all brokers down")] * 1000, deadline=0.0)
    with pytest.raises(RuntimeError, match=r"resume point of p\.steps\.train\[0\] unknown"):
        asyncio.run(asyncio.wait_for(positions.start_of("train", 0), 10))  # a deadline not kept fails, not hangs
    assert positions.known("train", 0) is None


def test_a_first_position_is_saved_at_once_covering_nothing_applied_later_ones_by_save() -> None:
    table: dict[bytes, bytes] = {}
    positions = new_positions(table, [])
    saved = AssemblyState(table)
    positions.advance("train", 2, 10)
    assert saved.applied_position(2, "train") == 9  # a new owner replays offset 10: its group change is not in the table yet
    assert new_positions(table, []).known("train", 2) == 10
    positions.advance("train", 2, 11)
    assert saved.applied_position(2, "train") == 9 and positions.known("train", 2) == 12
    positions.save(2)
    assert saved.applied_position(2, "train") == 11


def test_a_partition_is_read_directly_only_once_its_position_stops_moving_behind_the_log(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(positions_module.time, "monotonic", lambda: clock[0])
    positions = new_positions({}, [])
    assert not positions.stalled("train", 5, 0)  # empty
    assert not positions.stalled("train", 5, 10)  # never delivered: from now on
    clock[0] += positions_module.STALL_AFTER
    assert positions.stalled("train", 5, 10)
    positions.advance("train", 5, 3)  # Faust delivered a burst: moving again
    assert not positions.stalled("train", 5, 10)
    clock[0] += positions_module.STALL_AFTER / 2
    assert not positions.stalled("train", 5, 10)
    clock[0] += positions_module.STALL_AFTER / 2
    assert positions.stalled("train", 5, 10)  # stuck at 4 for STALL_AFTER
    positions.advance("train", 5, 9)
    assert not positions.stalled("train", 5, 10)  # caught up
    positions.forget()
    assert not positions.stalled("train", 5, 20)


def test_an_event_that_fails_half_way_is_applied_again_from_the_saved_position() -> None:
    """The worker's no-skip rule (``EventApplier.apply_at``): a failure drops the partition's unflushed
    changes and its in-memory position, so the next try starts at the saved position, this event included;
    other partitions keep theirs."""
    worker = new_worker(partitions=(3, 4))
    three, four = worker.source(3), worker.source(4)
    worker.deliver(three.append(step("a", "a1", last=False)))
    worker.deliver(four.append(step("b", "b1", last=False)))
    worker.tick()  # saved: partition 3 applied up to offset 0, group a holds a1#0; b likewise
    worker.deliver(three.append(step("a", "a1", index=1, last=False)))  # applied, not yet saved
    worker.deliver(four.append(step("b", "b1", index=1, last=False)))
    assembler, failures = worker.assembler, [ConnectionError("leader moved")]
    real_process = assembler.applier.process

    async def process(channel: str, partition: int, message: object) -> None:
        if failures:
            raise failures.pop()
        await real_process(channel, partition, message)

    assembler.applier.process = process  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        worker.deliver(three.append(step("a", "a1", index=2)))
    assert assembler.positions.known("train", 3) == 1, "the failed event's partition restarts at its saved position"
    assert not assembler.state.has_changes(3) and 3 not in assembler.reconciliation.reconciled
    assert assembler.positions.known("train", 4) == 2 and assembler.state.has_changes(4)
    assert 4 in assembler.reconciliation.reconciled
    worker.deliver(three.records[2])  # delivered again: offset 1 is read directly, then 2 applied
    assert assembler.positions.known("train", 3) == 3
    group = assembler.state.group(3, "train", "a")
    assert group is not None and group.trajectories == {"a1": {0: 0, 1: 1, 2: 2}}


def test_a_caught_up_partition_is_never_stalled(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(positions_module.time, "monotonic", lambda: clock[0])
    positions = SourcePositions(AssemblyState({}), "unused:9092", "g", "p", 30.0)
    positions.advance("train", 5, 9)
    assert not positions.stalled("train", 5, 10)
    clock[0] += positions_module.STALL_AFTER
    assert not positions.stalled("train", 5, 10)
