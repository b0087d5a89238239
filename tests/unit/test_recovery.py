"""Recovery's rules on an in-memory table, no broker: what ``test_worker_recovery``, ``test_broker_restart`` and
``test_rollout_lifecycle`` prove through Kafka that needs none of it."""

from __future__ import annotations

import asyncio

import pytest

from trajbus.streams.wire import ledger
from trajbus.streams.worker import positions as positions_module
from tests.unit.worker_fakes import FakeSends, new_worker, step


def a_worker_that_died_between_emitting_and_recording():
    """A worker that wrote group ``g`` to the groups topic and died before the ledger or its table heard."""
    sends = FakeSends()
    first = new_worker(sends=sends)
    source = first.source()
    first.deliver(source.append(step("g", "a")))
    first.tick()

    async def died(channel: str, outcome: ledger.Outcome) -> None:
        raise ConnectionError("killed")

    sends.outcome = died  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        first.deliver(source.append(step("g", "b")))
    del sends.outcome  # the next owner's writes are acknowledged
    return first, source


def test_a_new_owner_writes_the_missing_ledger_outcome_and_never_emits_the_group_again():
    first, source = a_worker_that_died_between_emitting_and_recording()
    assert first.sends.emitted() == ["g"] and first.sends.ledger() == []
    second = new_worker(table=dict(first.table), sends=first.sends, reads=first.reads)  # takes the partition over
    second.deliver(source.records[1])  # redelivered from the saved position
    assert second.sends.emitted() == ["g"], "recovered as emitted, not emitted twice"
    assert second.sends.ledger() == [("g", "emitted", None)]
    assert second.sends.outcomes["train"][0].placed == [0, 0]
    marker = second.assembler.state.marker(0, "train", "g")
    assert marker is not None and marker.offset == 1, "the source offset the group's headers carry"
    assert second.assembler.state.group(0, "train", "g") is None
    assert second.assembler.state.watermark(0, "train") == {0: 0}
    assert second.assembler.metrics.duplicates.labels("train")._value.get() == 1


def test_reconciliation_reads_only_past_the_watermark():
    first, source = a_worker_that_died_between_emitting_and_recording()
    second = new_worker(table=dict(first.table), sends=first.sends, reads=first.reads)
    second.tick()
    assert second.sends.ledger() == [("g", "emitted", None)]
    second.table.pop(b"0|e|train|g")  # the marker expired
    second.assembler.recovery.forget()  # the next rebalance reconciles again
    second.tick()
    assert second.sends.ledger() == [("g", "emitted", None)], "below the watermark: recorded already"


def test_a_half_applied_event_is_applied_again_from_the_saved_position_after_a_rebalance():
    worker = new_worker(n_rollouts=3)
    source = worker.source()
    worker.deliver(source.append(step("g", "a")))
    worker.tick()
    worker.deliver(source.append(step("g", "b")))  # applied, its change not saved
    worker.assembler.recovery.forget()  # a rebalance before the tick: the change is dropped
    assert worker.assembler.state.group(0, "train", "g").complete_trajectories() == ["a"]
    worker.deliver(source.append(step("g", "c")))  # offset 2: offset 1 is read again directly first
    assert worker.sends.emitted() == ["g"]
    assert worker.sends.ledger() == [("g", "emitted", None)]


def test_records_the_consumer_skipped_are_read_directly_and_applied_in_order():
    worker = new_worker()
    source = worker.source()
    skipped = [source.append(step("g", "a")), source.append(step("h", "a"))]
    worker.deliver(source.append(step("g", "b")))  # Faust resumed past offsets 0 and 1
    assert worker.sends.emitted() == ["g"]
    assert worker.assembler.state.group(0, "train", "h").trajectories == {"a": {0: 1}}
    assert worker.assembler.positions.known("train", 0) == 3
    for record in skipped:  # delivered late after all: replays
        worker.deliver(record)
    assert worker.sends.emitted() == ["g"]


def test_records_never_delivered_are_caught_up_once_the_position_stops_moving(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(positions_module.time, "monotonic", lambda: clock[0])
    worker = new_worker()
    source = worker.source()
    worker.deliver(source.append(step("g", "a")))
    source.append(step("g", "b"))  # on the log, never delivered
    asyncio.run(worker.assembler.recovery.catch_up())
    assert worker.sends.emitted() == []  # not yet: Faust may deliver it
    clock[0] += positions_module.STALL_AFTER
    asyncio.run(worker.assembler.recovery.catch_up())
    assert worker.sends.emitted() == ["g"]
    assert worker.assembler.positions.known("train", 0) == 2


def test_a_partition_never_delivered_is_caught_up_from_the_resume_point(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(positions_module.time, "monotonic", lambda: clock[0])
    worker = new_worker()
    source = worker.source()
    source.append(step("g", "a"))
    source.append(step("g", "b"))  # nothing delivered
    asyncio.run(worker.assembler.recovery.catch_up())
    assert worker.sends.emitted() == []
    clock[0] += positions_module.STALL_AFTER
    asyncio.run(worker.assembler.recovery.catch_up())
    assert worker.sends.emitted() == ["g"] and worker.assembler.positions.known("train", 0) == 2
