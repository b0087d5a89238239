"""Group commits of the trajectory state: many calls' changes in one transaction, each durable before its
caller goes on, a failed batch raised to every waiter, and a busy connection committed from the writer thread."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from trajbus.gateway.state.commits import GroupCommit
from trajbus.gateway.state.trajectories import RESERVED_STEPS, Trajectory, TrajectoryStore


def on_disk(path) -> dict[str, tuple[int, int, int]]:
    """(next_step, reserved_steps, published_steps) of every trajectory, as another process reads them."""
    with sqlite3.connect(path) as db:
        return {uid: (n, r, p) for uid, n, r, p in db.execute(
            "SELECT trajectory_uid, next_step, reserved_steps, published_steps FROM trajectories")}


def test_calls_in_flight_share_commits_and_each_is_durable_when_its_write_returns(tmp_path):
    store = TrajectoryStore(tmp_path)
    uids = [f"t{i}" for i in range(64)]
    for uid in uids:
        store.create(Trajectory(uid, "p", "train"))
    seen: dict[str, tuple[int, int]] = {}

    async def call(uid: str) -> None:
        first = await store.write(store.take_steps, uid, 1)
        assert on_disk(store.path)[uid][1] > first  # the index is reserved for good before it is sent
        await store.write(store.record_published, uid, first, 1, [{"role": "user", "content": uid}],
                          "http://a:1", [1, 2, 3], first)
        seen[uid] = on_disk(store.path)[uid]

    async def calls() -> None:
        for _ in range(2):
            await asyncio.gather(*(call(uid) for uid in uids))

    try:
        asyncio.run(calls())
        assert seen == {uid: (2, 1 + RESERVED_STEPS, 2) for uid in uids}
        assert store._commits.changes == 3 * len(uids)  # the second index was reserved: no commit awaited for it
        assert store._commits.commits <= 8  # one per wave of the 64 calls' changes, not one per change
    finally:
        store.close()


def test_a_failed_batch_is_raised_to_every_waiter_and_nothing_of_it_is_kept(tmp_path):
    db = sqlite3.connect(tmp_path / "s.db", check_same_thread=False, isolation_level=None)
    db.execute("CREATE TABLE t (k TEXT PRIMARY KEY)")
    lock, forgotten = threading.RLock(), []
    with ThreadPoolExecutor(1) as writer:
        commits = GroupCommit(db, lock, writer, on_failure=forgotten.append)

        async def two_changes() -> list:
            with lock:
                commits.queue("a", ("INSERT INTO t VALUES (?)", ("x",)))
                commits.queue("b", ("INSERT INTO t VALUES (?)", ("x",)))  # the same key: the batch fails
                batch = commits.open_batch()
            return await asyncio.gather(commits.wait(batch), commits.wait(batch), return_exceptions=True)

        errors = asyncio.run(two_changes())
    assert [type(e) for e in errors] == [sqlite3.IntegrityError] * 2
    assert forgotten == [{"a", "b"}] and not db.in_transaction
    assert db.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 0  # not half of it either
    db.close()


def test_a_batch_queued_while_another_thread_holds_the_connection_commits_on_the_writer_thread(tmp_path):
    db = sqlite3.connect(tmp_path / "s.db", check_same_thread=False, isolation_level=None)
    db.execute("CREATE TABLE t (k TEXT PRIMARY KEY)")
    db.create_function("thread", 0, lambda: threading.current_thread().name)
    lock, held, release = threading.RLock(), threading.Event(), threading.Event()
    committed_on: list[str] = []

    def hold() -> None:  # a sweep holding the connection
        with lock:
            held.set()
            release.wait(10)

    with ThreadPoolExecutor(1, thread_name_prefix="writer") as writer:
        commits = GroupCommit(db, lock, writer, on_failure=lambda uids: None)
        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(10)

        async def change() -> None:
            commits.queue("a", ("INSERT INTO t VALUES (thread())", ()))
            batch = commits.open_batch()
            waiting = asyncio.ensure_future(commits.wait(batch))
            for _ in range(3):  # the waiter schedules the commit; the loop's next turn finds the connection held
                await asyncio.sleep(0)
            assert not waiting.done()
            release.set()
            await asyncio.wait_for(waiting, 10)
            committed_on.append(db.execute("SELECT k FROM t").fetchone()[0])

        asyncio.run(change())
        holder.join()
    assert committed_on[0].startswith("writer")
    db.close()


def test_a_change_queued_and_not_yet_committed_is_committed_before_the_table_is_read(tmp_path):
    store = TrajectoryStore(tmp_path, cached=1)
    try:
        store.create(Trajectory("t1", "p", "train"))
        store.take_steps("t1", 2)  # queued
        store.create(Trajectory("t2", "p", "train"))  # commits it first, and pushes t1 out of memory
        assert on_disk(store.path)["t1"] == (2, 2 + RESERVED_STEPS, 0)
        store.take_steps("t2", 1)
        assert store.get("t1").next_step == 2  # read t1: t2's take is committed first
        assert on_disk(store.path)["t2"] == (1, 1 + RESERVED_STEPS, 0)
        with pytest.raises(LookupError):
            store.take_steps("nope", 1)
    finally:
        store.close()


KILLED_AFTER_THREE_CALLS = """
import asyncio, os, sys
from pathlib import Path
from trajbus.gateway.state.trajectories import Trajectory, TrajectoryStore
store = TrajectoryStore(Path(sys.argv[1]))
store.create(Trajectory("t1", "p", "train"))
async def calls():
    return [await store.write(store.take_steps, "t1", 1) for _ in range(3)]
print(asyncio.run(calls()), store._commits.changes)
os._exit(0)  # killed: what is queued and not committed is lost
"""


def test_indices_within_the_reservation_await_no_commit_and_a_killed_gateways_successor_continues_past_them(
        tmp_path):
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_THREE_CALLS, str(tmp_path)], capture_output=True,
                            text=True, timeout=60, check=True)
    assert killed.stdout.split() == ["[0,", "1,", "2]", "1"]  # one commit awaited: the first call's, which reserved
    assert on_disk(tmp_path / "trajectories.sqlite3")["t1"] == (1, 1 + RESERVED_STEPS, 0)  # 1 and 2: in memory only
    store = TrajectoryStore(tmp_path, cached=1)
    try:  # indices 1 and 2 may have been sent: never used again
        assert store.take_steps("t1", 1) == 1 + RESERVED_STEPS
        store.create(Trajectory("t2", "p", "train"))  # t1 out of memory: read again, it goes on where it was
        assert store.take_steps("t1", 1) == 2 + RESERVED_STEPS
    finally:
        store.close()
    store = TrajectoryStore(tmp_path)
    try:  # closed in order: nothing skipped
        assert store.take_steps("t1", 1) == 3 + RESERVED_STEPS
    finally:
        store.close()


def test_an_index_whose_commit_failed_is_never_taken_again(tmp_path):
    store = TrajectoryStore(tmp_path)
    with sqlite3.connect(store.path) as db:  # the second call's commit fails, as on a full disk
        db.execute("CREATE TRIGGER full BEFORE UPDATE ON trajectories WHEN NEW.published_steps = 2 "
                   "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")
    for uid in ("t1", "t2"):
        store.create(Trajectory(uid, "p", "train"))

    async def call(uid: str) -> int:
        first = await store.write(store.take_steps, uid, 1)
        await store.write(store.record_published, uid, first, 1, [], "http://a:1", [1], first)
        return first

    try:
        for uid in ("t1", "t2"):
            assert asyncio.run(call(uid)) == 0
            with pytest.raises(sqlite3.IntegrityError):
                asyncio.run(call(uid))  # index 1 was sent; its take was in the batch that failed
        assert store.take_steps("t1", 1) == 1 + RESERVED_STEPS  # read again, in this process
        assert store.get("t1").acknowledged == [0]
    finally:
        store.close()
    store = TrajectoryStore(tmp_path)
    try:  # closed in order after the failure: t2's index 1 is still never handed out again
        assert store.take_steps("t2", 1) == 1 + RESERVED_STEPS
    finally:
        store.close()
