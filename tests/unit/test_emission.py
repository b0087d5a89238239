"""Emission's rules on an in-memory table, no broker: what the integration tests prove through Kafka
(``test_first_path``, ``test_stream_rules``, ``test_rollout_lifecycle``) that needs none of it."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from trajbus.streams.wire import chunks, codec, ledger
from trajbus.streams.wire.headers import SOURCE_OFFSET, SOURCE_PARTITION
from trajbus.streams.wire.records import ChunkedGroup, ReadyGroup
from tests.unit.worker_fakes import abandon, new_worker, step


def test_a_ready_group_is_emitted_once_and_its_replayed_events_are_duplicates():
    worker = new_worker()
    source = worker.source()
    events = [source.append(step("g", "a", reward=1.0)), source.append(step("g", "b"))]
    for record in events:
        worker.deliver(record)
    assert worker.sends.emitted() == ["g"]
    group = codec.decode(worker.sends.groups["train"][0].value)
    assert isinstance(group, ReadyGroup) and group.trajectory_uids == ["a", "b"] and group.status == "complete"
    assert worker.sends.groups["train"][0].header(SOURCE_PARTITION) == b"0"
    assert worker.sends.groups["train"][0].header(SOURCE_OFFSET) == b"1", "the offset of its last event"
    assert worker.sends.ledger() == [("g", "emitted", None)]
    assert worker.sends.outcomes["train"][0].placed == [0, 0]
    worker.assembler.recovery.forget()  # a rebalance: events since the saved position come again
    for record in events:
        worker.deliver(record)
    assert worker.sends.emitted() == ["g"], "a replay must not emit the group again"
    assert worker.assembler.metrics.duplicates.labels("train")._value.get() == 2


def test_a_step_after_its_group_was_emitted_is_late_and_goes_to_the_dlq():
    worker = new_worker()
    source = worker.source()
    for event in [step("g", "a"), step("g", "b"), step("g", "c")]:
        worker.deliver(source.append(event))
    assert worker.sends.emitted() == ["g"]
    assert worker.sends.reasons() == ["late: group already emitted"]
    assert worker.assembler.metrics.late.labels("train")._value.get() == 1


def test_the_group_is_on_the_groups_topic_before_the_table_records_it():
    """A write of the group that fails leaves no outcome: the event is applied again and the group emitted."""
    worker = new_worker()
    source = worker.source()
    worker.deliver(source.append(step("g", "a")))
    worker.tick()
    worker.sends.fail_groups = 1
    with pytest.raises(ConnectionError):
        worker.deliver(source.append(step("g", "b")))
    assert worker.assembler.state.marker(0, "train", "g") is None and worker.sends.ledger() == []
    worker.deliver(source.records[1])  # handled again (``GroupAssembler.handle``'s retry)
    assert worker.sends.emitted() == ["g"] and worker.sends.ledger() == [("g", "emitted", None)]


def test_the_ledger_hears_an_outcome_before_the_table_records_it():
    worker = new_worker()
    source = worker.source()
    worker.deliver(source.append(step("g", "a")))
    worker.tick()

    async def unacknowledged(channel: str, outcome: ledger.Outcome) -> None:
        raise ConnectionError("the ledger's leader is away")

    worker.sends.outcome = unacknowledged  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        worker.deliver(source.append(step("g", "b")))
    assert worker.assembler.state.marker(0, "train", "g") is None


def test_a_group_abandoned_before_it_is_ready_is_dropped_and_its_later_steps_are_late():
    worker = new_worker()
    source = worker.source()
    worker.deliver(source.append(step("g", "a")))
    worker.deliver(source.append(abandon("g")))
    worker.deliver(source.append(step("g", "b")))
    assert worker.sends.emitted() == []
    assert worker.sends.ledger() == [("g", "dropped", ledger.ABANDONED)]
    assert worker.sends.reasons() == ["late: group already dropped (abandoned)"]
    assert worker.assembler.state.group(0, "train", "g") is None


def test_an_abandon_after_the_group_was_emitted_leaves_it_emitted():
    worker = new_worker()
    source = worker.source()
    for event in [step("g", "a"), step("g", "b"), abandon("g")]:
        worker.deliver(source.append(event))
    assert worker.sends.emitted() == ["g"]
    assert worker.sends.ledger() == [("g", "emitted", None)], "the outcome stands: no drop follows it"
    marker = worker.assembler.state.marker(0, "train", "g")
    assert marker is not None and marker.outcome == "emitted"
    assert worker.assembler.metrics.duplicates.labels("train")._value.get() == 1


def test_a_group_the_filters_drop_is_settled_on_the_ledger_not_emitted():
    worker = new_worker(drop_equal_rewards=True)
    source = worker.source()
    for event in [step("flat", "a"), step("flat", "b"), step("kept", "a", reward=1.0), step("kept", "b")]:
        worker.deliver(source.append(event))
    assert worker.sends.emitted() == ["kept"]
    assert worker.sends.ledger() == [("flat", "dropped", "equal_rewards"), ("kept", "emitted", None)]


def test_a_timed_out_group_is_emitted_partial_with_min_rollouts_else_dropped():
    worker = new_worker(n_rollouts=3, group_timeout=5.0, min_rollouts=2)
    source = worker.source()
    for event in [step("two", "a"), step("two", "b"), step("one", "a")]:
        worker.deliver(source.append(event))
    assert worker.sends.emitted() == []
    worker.tick()  # the tick flushes the partition's changes before it looks for timeouts
    pending = asyncio.run(worker.assembler.sweep(time.time() + 1.0, expire=False))
    assert pending["train"] == (2, 3) and worker.sends.emitted() == []
    asyncio.run(worker.assembler.sweep(time.time() + 6.0, expire=False))
    assert worker.sends.emitted() == ["two"]
    assert codec.decode(worker.sends.groups["train"][0].value).status == "partial"
    assert sorted(worker.sends.ledger()) == [("one", "dropped", "timeout"), ("two", "emitted", None)]


def test_a_group_over_max_group_bytes_goes_to_the_dlq_by_its_reason_alone():
    worker = new_worker(max_group_bytes=10)
    source = worker.source()
    for event in [step("big", "a"), step("big", "b")]:
        worker.deliver(source.append(event))
    assert worker.sends.emitted() == []
    [letter] = worker.sends.dead_letters
    assert letter.key == b"big" and letter.value is None and letter.reason.startswith("too_large: group of ")
    assert (letter.topic, letter.partition, letter.offset) == ("p.steps.train", 0, 1)
    assert worker.sends.ledger() == [("big", "dropped", "too_large")]


def test_a_group_over_max_message_bytes_is_written_as_chunks_named_by_a_manifest():
    worker = new_worker()
    emission = worker.assembler.emission
    emission.settings = dataclasses.replace(emission.settings, topics=dataclasses.replace(
        emission.settings.topics, max_message_bytes=chunks.RECORD_OVERHEAD + 64))
    source = worker.source()
    for event in [step("g", "a"), step("g", "b")]:
        worker.deliver(source.append(event))
    manifest = codec.decode(worker.sends.groups["train"][0].value)
    pieces = [w.value for w in worker.sends.chunk_records["train"]]
    assert isinstance(manifest, ChunkedGroup) and manifest.topic == "p.chunks.train"
    assert len(pieces) > 1 and manifest.offsets == list(range(len(pieces)))
    assert isinstance(codec.decode(b"".join(pieces)), ReadyGroup)
    assert worker.sends.ledger() == [("g", "emitted", None)]


def test_an_emitted_groups_step_bodies_leave_memory():
    worker = new_worker()
    source = worker.source()
    worker.deliver(source.append(step("g", "a")))
    assert worker.assembler.bodies.bytes_in_use > 0
    worker.deliver(source.append(step("g", "b")))
    assert worker.sends.emitted() == ["g"] and worker.assembler.bodies.bytes_in_use == 0


def test_a_redelivered_undecodable_record_goes_to_the_dead_letters_once():
    worker = new_worker()
    record = worker.source().append(b"not a record")
    worker.deliver(record)
    worker.deliver(record)
    assert len(worker.sends.dead_letters) == 1
    assert worker.assembler.metrics.duplicates.labels("train")._value.get() == 1
