"""The gateway's SQLite trajectory state: lookups, step indices, acknowledged steps, completion, restarts."""

from __future__ import annotations

import sqlite3
import time

import pytest

from trajbus.gateway.state.trajectories import ABANDONED, COMPLETED, COMPLETING, OPEN, Trajectory, TrajectoryStore


@pytest.fixture
def store(tmp_path):
    store = TrajectoryStore(tmp_path / "state")
    yield store
    store.close()


def new(store, uid="t1", **kwargs):
    store.create(Trajectory(uid, "p1", "train", **kwargs))


def test_create_then_get(store):
    new(store, n_rollouts=4, metadata={"task": "math"}, policy_version=3, backend="http://a:1")
    t = store.get("t1")
    assert (t.prompt_uid, t.channel, t.n_rollouts, t.metadata) == ("p1", "train", 4, {"task": "math"})
    assert (t.policy_version, t.backend, t.next_step, t.published_steps, t.status) == (3, "http://a:1", 0, 0, OPEN)
    assert t.last_conversation is None


def test_unknown_trajectory(store):
    assert store.get("nope") is None
    with pytest.raises(LookupError, match="nope is not open"):
        store.take_steps("nope", 1)
    assert store.transition("nope", OPEN, COMPLETING) is False


def test_a_uid_is_created_once(store):
    new(store)
    with pytest.raises(sqlite3.IntegrityError):
        new(store)


def test_taking_steps_hands_out_consecutive_indices(store):
    new(store)
    assert store.take_steps("t1", 1) == 0
    assert store.take_steps("t1", 3) == 1
    assert store.take_steps("t1", 1) == 4
    assert store.get("t1").next_step == 5


def test_an_index_taken_by_a_step_never_acknowledged_is_neither_reused_nor_a_member(store):
    new(store)
    store.record_published("t1", store.take_steps("t1", 1), 1, [], "http://a:1", [1], 0)
    store.take_steps("t1", 1)  # sent, acknowledgement lost: the record may still land with index 1
    third = store.take_steps("t1", 1)
    store.record_published("t1", third, 1, [], "http://a:1", [1, 2], third)
    assert third == 2
    assert (store.get("t1").acknowledged, store.get("t1").published_steps) == ([0, 2], 2)


def test_record_published_keeps_indices_conversation_and_backend(store):
    new(store)
    assert (store.get("t1").context_ids, store.get("t1").context_step, store.get("t1").acknowledged) == \
        (None, None, [])
    store.record_published("t1", 0, 2, [{"role": "user", "content": "hi"}], "http://b:1", [1, 2], 0)
    store.record_published("t1", 2, 1, [{"role": "assistant", "content": "yo"}], "http://c:1", [1, 2, 3, 150_000], 2)
    t = store.get("t1")
    assert (t.published_steps, t.acknowledged, t.backend) == (3, [0, 1, 2], "http://c:1")
    assert t.last_conversation == [{"role": "assistant", "content": "yo"}]
    assert (t.context_ids.tolist(), t.context_step) == ([1, 2, 3, 150_000], 2)


def test_state_of_an_older_gateway_gains_the_token_state_columns(tmp_path):
    (tmp_path / "state").mkdir()
    old = sqlite3.connect(tmp_path / "state" / "trajectories.sqlite3")
    old.execute("CREATE TABLE trajectories (trajectory_uid TEXT PRIMARY KEY, prompt_uid TEXT NOT NULL, "
                "channel TEXT NOT NULL, n_rollouts INTEGER, metadata TEXT NOT NULL, policy_version INTEGER, "
                "backend TEXT, next_step INTEGER NOT NULL DEFAULT 0, published_steps INTEGER NOT NULL DEFAULT 0, "
                "status TEXT NOT NULL, last_conversation TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL)")
    old.execute("INSERT INTO trajectories VALUES ('t0','p','train',NULL,'{}',NULL,NULL,1,1,'open',NULL,0,0)")
    old.execute("INSERT INTO trajectories VALUES ('fresh','p','train',NULL,'{}',NULL,NULL,0,0,'open',NULL,0,0)")
    old.commit()
    old.close()
    store = TrajectoryStore(tmp_path / "state")
    try:
        assert (store.get("t0").published_steps, store.get("t0").context_ids) == (1, None)
        store.record_published("t0", 1, 1, [], "http://a:1", [7], 1)
        # Step 0 was published by the older gateway, which did not record indices: unknown, not [1].
        assert (store.get("t0").context_ids.tolist(), store.get("t0").acknowledged,
                store.get("t0").published_steps) == ([7], None, 2)
        store.record_published("fresh", 0, 1, [], "http://a:1", [7], 0)
        assert store.get("fresh").acknowledged == [0]
    finally:
        store.close()


def test_completing_twice_succeeds_once_and_takes_no_more_steps(store):
    new(store)
    assert store.transition("t1", OPEN, COMPLETING) is True
    assert store.transition("t1", OPEN, COMPLETING) is False
    with pytest.raises(LookupError):
        store.take_steps("t1", 1)  # no new steps while completing
    assert store.transition("t1", COMPLETING, COMPLETED) is True
    assert store.transition("t1", OPEN, COMPLETING) is False
    assert store.get("t1").status == COMPLETED


def test_update_sets_columns_and_json_fields(store):
    new(store)
    store.update("t1", metadata={"k": [1]}, policy_version=7)
    t = store.get("t1")
    assert (t.metadata, t.policy_version) == ({"k": [1]}, 7)


def test_state_survives_reopening_and_an_interrupted_completion_stays_completing(tmp_path):
    first = TrajectoryStore(tmp_path)
    for uid in ("done", "cut", "open"):
        new(first, uid, metadata={"uid": uid})
    first.record_published("open", first.take_steps("open", 3), 3, [{"role": "user", "content": "q"}], "http://a:1",
                           [5, 6], 0)
    first.transition("done", OPEN, COMPLETING)
    first.transition("done", COMPLETING, COMPLETED)
    first.transition("cut", OPEN, COMPLETING)  # the process dies here
    first.close()

    second = TrajectoryStore(tmp_path)
    try:
        assert second.counts() == {OPEN: 1, COMPLETING: 1, COMPLETED: 1}  # its end may have landed
        t = second.get("open")
        assert (t.metadata, t.published_steps, t.backend) == ({"uid": "open"}, 3, "http://a:1")
        assert t.acknowledged == [0, 1, 2]
        assert second.take_steps("open", 1) == 3  # numbering continues after the restart
        with pytest.raises(LookupError):
            second.take_steps("cut", 1)
    finally:
        second.close()


def test_the_state_shrinks_back_after_a_burst(store):
    """Completed trajectories lose their conversation at once and their row after the retention;
    idle ones are abandoned, then removed the same way."""
    empty = store.bytes_in_use()
    conversation = [{"role": "user", "content": "x" * 4000}]
    for i in range(200):
        new(store, uid=f"t{i}")
        store.take_steps(f"t{i}", 1)
        store.record_published(f"t{i}", 0, 1, conversation, "http://a:1", list(range(2000)), 0)
    peak = store.bytes_in_use()
    for i in range(100):  # half complete, half go idle
        store.transition(f"t{i}", OPEN, COMPLETING)
        store.transition(f"t{i}", COMPLETING, COMPLETED)
    done = store.get("t0")
    assert done.last_conversation is None and done.context_ids is None and done.acknowledged == [0]

    abandoned, removed = store.sweep(idle_before=time.time() + 1, finished_before=0)
    assert sorted(abandoned) == sorted(f"t{i}" for i in range(100, 200)) and removed == 0
    assert store.counts() == {COMPLETED: 100, ABANDONED: 100}
    assert store.unfinished() == []
    with pytest.raises(LookupError):
        store.take_steps("t150", 1)  # an abandoned trajectory takes no more calls

    assert store.sweep(idle_before=0, finished_before=time.time() + 1) == ([], 200)
    assert store.counts() == {} and store.get("t0") is None
    assert store.bytes_in_use() < peak / 10 and store.bytes_in_use() <= empty + 64 * 1024


def test_a_call_writes_only_what_it_adds_and_a_reopened_store_replays_the_turns(tmp_path):
    first = TrajectoryStore(tmp_path / "state")
    new(first)
    q1 = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    q2 = q1 + [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    edited = [{"role": "user", "content": "q1, edited"}, {"role": "assistant", "content": "b1"}]
    first.record_published("t1", 0, 1, q1, "http://a:1", list(range(1000)), 0)
    first.record_published("t1", 1, 1, q2, "http://a:1", list(range(1500)), 1)  # extends: 500 new ids
    with first._lock:
        first._commits.commit()  # the queued group commit, as any other use of the connection would
    turns = first._db.execute("SELECT kept_messages, messages, kept_ids, length(ids) FROM turns "
                              "ORDER BY first_step").fetchall()
    assert turns[1][0] == 2 and turns[1][2] == 1000 and turns[1][3] == 500 * 4  # the new part only
    first.record_published("t1", 2, 1, edited, "http://a:1", [7, 8, 9], 2)  # a new segment keeps nothing
    first.close()

    reopened = TrajectoryStore(tmp_path / "state")  # a restarted gateway: nothing in memory
    t = reopened.get("t1")
    assert (t.last_conversation, t.context_ids.tolist(), t.context_step, t.acknowledged) == \
        (edited, [7, 8, 9], 2, [0, 1, 2])
    assert reopened.transition("t1", OPEN, COMPLETING) and reopened.transition("t1", COMPLETING, COMPLETED)
    assert reopened._db.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 0  # a finished one keeps none
    reopened.close()
