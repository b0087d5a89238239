"""The worker's typed state: the table's bytes as today's changelog holds them, and pending groups written behind."""

from __future__ import annotations

from trajbus.streams.worker.assembly import PendingGroup
from trajbus.streams.worker import state_store
from trajbus.streams.worker.state_store import AssemblyState, partition_of

# Keys and values exactly as the worker before the typed store wrote them (StateKey by hand, json.dumps).
PENDING = PendingGroup(prompt_uid="p2", channel="train", trajectories={"t": {0: 5}}, first_seen=1.5, last_offset=5)
TODAYS_CHANGELOG = {
    b"3|o|train|": b"41",
    b"3|e|train|p1": b'{"offset": 12, "at": 1700000000.25, "outcome": "emitted"}',
    b"3|w|train|": b'{"0": 7, "2": 3}',
    b"3|g|train|p2": PENDING.encode(),
}


def test_a_table_written_by_todays_worker_reads_back_as_it_was_meant():
    state = AssemblyState(dict(TODAYS_CHANGELOG))
    assert state.applied_position(3, "train") == 41
    marker = state.marker(3, "train", "p1")
    assert marker is not None and (marker.offset, marker.at, marker.outcome) == (12, 1700000000.25, "emitted")
    assert state.watermark(3, "train") == {0: 7, 2: 3}
    group = state.group(3, "train", "p2")
    assert group is not None and group.trajectories == {"t": {0: 5}} and group.last_offset == 5
    assert state.applied_position(4, "train") is None and state.marker(3, "train", "p2") is None
    assert state.watermark(4, "train") == {}


def test_writes_keep_todays_keys_and_value_encodings(monkeypatch):
    monkeypatch.setattr(state_store.time, "time", lambda: 1700000001.5)
    table = dict(TODAYS_CHANGELOG)
    state = AssemblyState(table)
    state.save_position(3, "train", 42)
    state.advance_watermark(3, "train", 0, 8)
    state.advance_watermark(3, "train", 2, 1)  # behind: no change
    cleared = state.record_outcome(3, "train", "p2", 5, "dropped (timeout)")
    assert cleared is not None and cleared.prompt_uid == "p2"
    assert table[b"3|o|train|"] == b"42"
    assert table[b"3|w|train|"] == b'{"0": 8, "2": 3}'
    assert b"3|g|train|p2" not in table
    assert table[b"3|e|train|p2"] == b'{"offset": 5, "at": 1700000001.5, "outcome": "dropped (timeout)"}'
    assert {partition_of(key) for key in table} == {3}


def test_a_changed_group_reaches_the_table_only_when_its_partition_is_flushed():
    table: dict[bytes, bytes] = {}
    state = AssemblyState(table)
    group = state.open_group(1, "train", "p")
    group.last_offset = 9
    state.update_group(1, group)
    assert table == {} and state.group(1, "train", "p") is group  # held: as it stands, not as stored
    state.flush(2)
    assert table == {}
    state.flush(1)
    assert PendingGroup.decode(table[b"1|g|train|p"]).last_offset == 9
    group.last_offset = 10
    state.update_group(1, group)
    state.drop_changes(1)  # an event failed half-way: its change is dropped
    stored = state.group(1, "train", "p")
    assert stored is not None and stored.last_offset == 9


def test_expired_markers_go_and_fresh_ones_stay():
    table: dict[bytes, bytes] = {}
    state = AssemblyState(table)
    state.record_outcome(0, "train", "old", 1, "emitted")
    state.record_outcome(0, "train", "new", 2, "emitted")
    table[b"0|e|train|old"] = b'{"offset": 1, "at": 100.0, "outcome": "emitted"}'
    assert state.expire_markers(0, state.index(), now=1000.0, ttl=500.0) == 1
    assert state.marker(0, "train", "old") is None and state.marker(0, "train", "new") is not None
