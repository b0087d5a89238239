"""Per-trajectory state that outlives the gateway process.

A black-box agent holds only a URL; everything else (channel, group size,
metadata, the step counter, the backend with its prefix cache, the last
conversation for the reward function) lives here, in SQLite under
``--state-dir``. Every change is committed before the gateway acts on it (sends
the steps, answers), and a committed transaction survives SIGKILL of the process,
so a restarted gateway continues the same trajectories with the right step
indices. The changes of the calls in flight are committed together
(``gateway.state.commits``); a commit writes the WAL only (no fsync,
``synchronous=NORMAL``), in place on the event loop when no other thread holds the
connection, and a checkpointer thread copies the WAL into the database, so a
call never waits for a disk flush.

A call takes its step indices when it publishes (under the trajectory's publish
lock, after the engine answered) and never gives them back: a record whose fate
is unknown (not acknowledged in time, the gateway killed while waiting) may still
reach the broker, so its index is never used again. The disk holds a reservation
ahead of them (``reserved_steps``, ``RESERVED_STEPS`` at a time), whose commit a call
past it awaits; within it, a call's index rides in the next commit and nothing is
awaited. A gateway killed (or whose commit failed) continues past the reservation:
a gap, which the acknowledged list leaves out; one closed in order leaves none.

The indices the broker did acknowledge are kept (``acknowledged``); the
trajectory's end names them, and the worker assembles exactly those steps, so a gap is never waited for and an
unacknowledged record never reaches the trainer.

Completing works the same way: ``completing`` is entered before the end is
sent and left for ``completed`` when it is acknowledged; an end whose fate is
unknown (or a gateway killed while sending it) leaves the trajectory
``completing``: it takes no more calls, and the agent's retry sends the same
end again (the worker counts the first to arrive).

The token state of the conversation (``context_ids``: the last prompt and the
response sampled for it, and the index of that step) and the conversation itself
are kept as turns, each what a call added (packed 32-bit ids, JSON messages) and
how much of the previous state it kept, so a call writes its new tokens and
messages, never the whole conversation, and a restarted gateway replays them to
continue token-exactly. The trajectories in use are also held in memory (a
bounded write-through cache), so a call reads nothing from disk.

The state is bounded (``sweep``): a trajectory without a call for the idle
timeout is ``abandoned`` (it takes no more calls; the worker's group timeout
decides its group, as for any trajectory that never ends), the conversation
and token state of a finished trajectory are dropped at once, and a finished
row is removed once a late duplicate ``complete_trajectory`` no longer needs
its 409.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from trajbus.gateway.prompts.token_ids import TokenIds, packed
from trajbus.gateway.state.commits import Checkpointer, GroupCommit
from trajbus.gateway.state.snapshots import Snapshots
from trajbus.streams.wire.token_prefix import begins_with

T = TypeVar("T")
log = logging.getLogger("trajbus.gateway")
OPEN, COMPLETING, COMPLETED, ABANDONED = "open", "completing", "completed", "abandoned"
CACHED_TRAJECTORIES = 8192
"""Open trajectories held in memory by default: twice the calls an instance serves at once by default."""
RESERVED_STEPS = 64
"""Step indices a trajectory reserves on disk at a time: one commit awaited for the indices of 64 calls, not
one a call; a gateway killed mid-trajectory skips at most this many (the trajectory's end names only those
acknowledged)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectories (
    trajectory_uid TEXT PRIMARY KEY,
    prompt_uid TEXT NOT NULL,
    channel TEXT NOT NULL,
    n_rollouts INTEGER,
    metadata TEXT NOT NULL,
    policy_version INTEGER,
    backend TEXT,
    next_step INTEGER NOT NULL DEFAULT 0,
    published_steps INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL,
    last_conversation TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    context_ids BLOB,
    context_step INTEGER,
    acknowledged BLOB,
    reserved_steps INTEGER
)
"""
_INDEX = "CREATE INDEX IF NOT EXISTS trajectories_by_status ON trajectories (status, updated_at)"
_TURNS = """
CREATE TABLE IF NOT EXISTS turns (
    trajectory_uid TEXT NOT NULL,
    first_step INTEGER NOT NULL,
    kept_messages INTEGER NOT NULL,
    messages TEXT NOT NULL,
    kept_ids INTEGER NOT NULL,
    ids BLOB NOT NULL,
    PRIMARY KEY (trajectory_uid, first_step)
)
"""
# Columns absent from the state of older gateways, added when it is opened:
_ADDED_COLUMNS = {"context_ids": "BLOB", "context_step": "INTEGER", "acknowledged": "BLOB",
                  "reserved_steps": "INTEGER"}


@dataclass
class Trajectory:
    trajectory_uid: str
    prompt_uid: str
    channel: str
    n_rollouts: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    policy_version: int | None = None
    """Set by ``register_trajectory``; else steps take the policy topic's version."""
    backend: str | None = None
    next_step: int = 0
    reserved_steps: int = 0
    """The first index not reserved on disk (``RESERVED_STEPS``): where a gateway killed meanwhile continues."""
    published_steps: int = 0
    status: str = OPEN
    last_conversation: list[dict[str, Any]] | None = None
    created_at: float = field(default_factory=time.time)
    context_ids: TokenIds | None = None
    """Prompt + sampled response of step ``context_step``: what the next call continues (a token array:
    4 bytes a token, ``gateway.prompts.token_ids``)."""
    context_step: int | None = None
    acknowledged: list[int] | None = field(default_factory=list)
    """Indices of the steps the broker acknowledged: what the trajectory consists of. None: unknown (steps
    published by a gateway that did not record them; its end then names no steps)."""


def _pack(ids: list[int] | TokenIds) -> bytes:
    """32-bit ids as stored: a token array's bytes (those ``array('i')`` wrote, for ids below 2**31)."""
    return packed(ids).tobytes()


def _unpack_ids(blob: bytes) -> TokenIds:
    ids = packed(())
    ids.frombytes(blob)
    return ids


def _unpack(blob: bytes | None) -> list[int] | None:
    return None if blob is None else _unpack_ids(blob).tolist()


def _kept(before: Sequence | None, after: Sequence) -> int:
    """How much of the previous state the new one starts with: all of it, or (a new segment) none."""
    return len(before) if before and begins_with(after, before) else 0


def _acknowledged(blob: bytes | None, published: int) -> list[int] | None:
    """The acknowledged indices; None when steps were published before the gateway recorded them."""
    if blob is None:
        return None if published else []
    return _unpack(blob)


class TrajectoryStore:
    """SQLite (WAL) table of trajectories behind an in-memory cache; safe to call from any thread.

    A change (``write``) is made on the event loop when the connection is free, else on one writer thread, so
    a sweep holding the connection never holds the loop. A call's changes (``take_steps``,
    ``record_published``) change the memory at once and are queued for a group commit (``GroupCommit``: a WAL
    append, no fsync), which ``write`` awaits; every other use of the connection commits the queue first.
    Reads of trajectories in use come from memory.
    """

    def __init__(self, directory: Path, cached: int = CACHED_TRAJECTORIES) -> None:
        """``cached``: trajectories held in memory (the most recently used); another one is read, and its turns
        replayed, when used (``--cached-trajectories``)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "trajectories.sqlite3"
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes
        self._db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer's thread does it, never a commit
        self._db.execute(_SCHEMA)
        present = {row[1] for row in self._db.execute("PRAGMA table_info(trajectories)")}
        for name, kind in _ADDED_COLUMNS.items():
            if name not in present:
                self._db.execute(f"ALTER TABLE trajectories ADD COLUMN {name} {kind}")
        self._db.execute(_INDEX)
        self._db.execute(_TURNS)
        self._lock = threading.RLock()
        """Guards the connection (re-entered: a change made in place holds it around the change's own use)."""
        self._snapshots: Snapshots[Trajectory] = Snapshots(cached)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="trajectory-state")
        self._past_reservation: set[str] = set()
        """Trajectories whose last indices taken a failed commit may have lost: read again, they continue past
        their reservation."""
        self._lost_commits = False
        """A commit failed: the disk's ``next_step`` may be behind what was sent, so ``close`` keeps reservations."""
        # The gateway before this one, killed, may have sent indices it took and never committed: past them.
        self._db.execute("UPDATE trajectories SET next_step = reserved_steps WHERE reserved_steps > next_step")
        self._commits = GroupCommit(self._db, self._lock, self._writer, on_failure=self._forget)
        self._checkpointer = Checkpointer(self.path)

    def _row(self, row: tuple) -> Trajectory:
        (uid, prompt_uid, channel, n_rollouts, metadata, version, backend, next_step, published, status,
         conversation, created_at, _updated, context_ids, context_step, acknowledged, reserved) = row
        reserved = next_step if reserved is None else reserved
        if uid in self._past_reservation:  # a failed commit may have lost the last indices taken
            self._past_reservation.discard(uid)
            next_step = max(next_step, reserved)
        return Trajectory(uid, prompt_uid, channel, n_rollouts, json.loads(metadata), version, backend, next_step,
                          reserved, published, status, json.loads(conversation) if conversation else None,
                          created_at, None if context_ids is None else _unpack_ids(context_ids), context_step,
                          _acknowledged(acknowledged, published))

    async def write(self, change: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Make one of the store's changes (``create``, ``take_steps``, ...) and return once it is committed:
        in place when the connection is free, else on the writer thread, which waits for it."""
        if self._lock.acquire(blocking=False):
            try:
                result, batch = self._locked(change, *args, **kwargs)
            finally:
                self._lock.release()
        else:
            result, batch = await asyncio.get_running_loop().run_in_executor(
                self._writer, partial(self._locked, change, *args, **kwargs))
        if batch is not None:  # queued for a group commit
            await self._commits.wait(batch)
        return result

    def _locked(self, change: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, Any]:
        """The change and the batch it queued in (None: it queued nothing, so it waits for no commit), under
        one hold of the lock (re-entered when held already)."""
        with self._lock:
            queued = self._commits.changes
            result = change(*args, **kwargs)
            return result, self._commits.open_batch() if self._commits.changes > queued else None

    def _forget(self, trajectory_uids: set[str]) -> None:
        """A group commit failed: these trajectories are read again from the disk, whose state is the truth,
        past their reservation."""
        self._past_reservation |= trajectory_uids
        self._lost_commits = True
        self._snapshots.drop(list(trajectory_uids))

    def get(self, trajectory_uid: str) -> Trajectory | None:
        """The trajectory as stored: from memory, else its row with its turns replayed. Never changed later."""
        trajectory = self._snapshots.get(trajectory_uid)
        if trajectory is not None:
            return trajectory
        with self._lock:
            self._commits.commit()
            row = self._db.execute("SELECT * FROM trajectories WHERE trajectory_uid = ?",
                                   (trajectory_uid,)).fetchone()
            if row is None:
                return None
            trajectory = self._row(row)
            for kept_messages, messages, kept_ids, ids in self._db.execute(
                    "SELECT kept_messages, messages, kept_ids, ids FROM turns WHERE trajectory_uid = ? "
                    "ORDER BY first_step", (trajectory_uid,)):
                trajectory.last_conversation = (trajectory.last_conversation or [])[:kept_messages] + \
                    json.loads(messages)
                trajectory.context_ids = (trajectory.context_ids or packed(()))[:kept_ids] + _unpack_ids(ids)
            self._snapshots.put(trajectory)
        return trajectory

    def create(self, trajectory: Trajectory) -> None:
        now = time.time()
        with self._lock:
            self._commits.commit()
            self._db.execute(
                "INSERT INTO trajectories VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,NULL,NULL,NULL,NULL)",
                (trajectory.trajectory_uid, trajectory.prompt_uid, trajectory.channel, trajectory.n_rollouts,
                 json.dumps(trajectory.metadata), trajectory.policy_version, trajectory.backend,
                 trajectory.next_step, trajectory.published_steps, trajectory.status, None, now, now))
            self._snapshots.put(dataclasses.replace(trajectory))

    def context_step(self, trajectory_uid: str) -> int | None:
        """The step the trajectory's token state ends with (None: no call published yet)."""
        trajectory = self.get(trajectory_uid)
        return None if trajectory is None else trajectory.context_step

    def update(self, trajectory_uid: str, **values: Any) -> None:
        """Set columns (not the conversation: it is kept by ``record_published``); ``metadata`` as JSON."""
        stored = {**values, **({"metadata": json.dumps(values["metadata"])} if "metadata" in values else {})}
        columns = ", ".join(f"{name} = ?" for name in stored)
        with self._lock:
            self._commits.commit()
            self._db.execute(f"UPDATE trajectories SET {columns}, updated_at = ? WHERE trajectory_uid = ?",
                             (*stored.values(), time.time(), trajectory_uid))
            self._snapshots.change(trajectory_uid, **values)

    def take_steps(self, trajectory_uid: str, count: int) -> int:
        """Take the next ``count`` step indices of an open trajectory for good; returns the first. Past the
        disk's reservation, ``RESERVED_STEPS`` more are reserved (queued: ``write`` awaits the commit before
        the steps are sent); within it, the index is written with the next commit (``GroupCommit.defer``)."""
        with self._lock:  # a status change holds it too: an index is never taken past the trajectory's end
            trajectory = self.get(trajectory_uid)
            if trajectory is None or trajectory.status != OPEN:
                raise LookupError(f"trajectory {trajectory_uid} is not open")
            first, reserved = trajectory.next_step, trajectory.reserved_steps
            if first + count > reserved:
                reserved = first + count + RESERVED_STEPS
                self._commits.queue(trajectory_uid, (
                    "UPDATE trajectories SET next_step = ?, reserved_steps = ?, updated_at = ? "
                    "WHERE trajectory_uid = ?", (first + count, reserved, time.time(), trajectory_uid)))
            else:  # reserved for good already: written with the next commit, awaited by nobody
                self._commits.defer(trajectory_uid, (
                    "UPDATE trajectories SET next_step = ?, updated_at = ? WHERE trajectory_uid = ?",
                    (first + count, time.time(), trajectory_uid)))
            self._snapshots.change(trajectory_uid, next_step=first + count, reserved_steps=reserved)
        return first

    def record_published(self, trajectory_uid: str, first: int, count: int, conversation: list[dict[str, Any]],
                         backend: str, context_ids: Sequence[int], context_step: int) -> None:
        """After the broker acknowledged a call's steps ``first``..``first + count - 1``: keep their
        indices, the backend, and as a turn what the conversation and its token state (packed) gained."""
        context_ids = packed(context_ids)
        with self._lock:
            before = self.get(trajectory_uid)
            if before is None:
                return
            acknowledged = None if before.acknowledged is None else \
                before.acknowledged + list(range(first, first + count))
            kept_messages = _kept(before.last_conversation, conversation)
            kept_ids = _kept(before.context_ids, context_ids)
            self._commits.queue(trajectory_uid, (
                "UPDATE trajectories SET published_steps = ?, acknowledged = ?, backend = ?, "
                "context_step = ?, updated_at = ? WHERE trajectory_uid = ?",
                (before.published_steps + count, None if acknowledged is None else _pack(acknowledged), backend,
                 context_step, time.time(), trajectory_uid)), (
                "INSERT OR REPLACE INTO turns VALUES (?,?,?,?,?,?)",
                (trajectory_uid, first, kept_messages, json.dumps(conversation[kept_messages:]), kept_ids,
                 _pack(context_ids[kept_ids:]))))
            self._snapshots.change(trajectory_uid, published_steps=before.published_steps + count,
                                   acknowledged=acknowledged, backend=backend, context_step=context_step,
                                   last_conversation=conversation, context_ids=context_ids)

    def transition(self, trajectory_uid: str, from_status: str, to_status: str) -> bool:
        """Atomic status change; False if the trajectory was not in ``from_status``. A completed
        trajectory keeps only what a late duplicate completion needs: no conversation, no token state."""
        finished = ", last_conversation = NULL, context_ids = NULL" if to_status == COMPLETED else ""
        with self._lock:
            self._commits.commit()
            cursor = self._db.execute(
                f"UPDATE trajectories SET status = ?, updated_at = ?{finished} WHERE trajectory_uid = ? AND status = ?",
                (to_status, time.time(), trajectory_uid, from_status))
            changed = cursor.rowcount == 1
            if changed and to_status == COMPLETED:
                self._db.execute("DELETE FROM turns WHERE trajectory_uid = ?", (trajectory_uid,))
                self._snapshots.drop([trajectory_uid])
            elif changed:
                self._snapshots.change(trajectory_uid, status=to_status)
        return changed

    def sweep(self, idle_before: float, finished_before: float) -> tuple[list[str], int]:
        """Abandon open (and completing) trajectories last used before ``idle_before``, remove finished
        ones last changed before ``finished_before``; returns (uids abandoned, rows removed)."""
        with self._lock:
            self._commits.commit()
            abandoned = [row[0] for row in self._db.execute(
                "UPDATE trajectories SET status = ?, last_conversation = NULL, context_ids = NULL, updated_at = ? "
                "WHERE status IN (?, ?) AND updated_at < ? RETURNING trajectory_uid",
                (ABANDONED, time.time(), OPEN, COMPLETING, idle_before)).fetchall()]
            self._db.executemany("DELETE FROM turns WHERE trajectory_uid = ?", [(uid,) for uid in abandoned])
            removed = [row[0] for row in self._db.execute(
                "DELETE FROM trajectories WHERE status IN (?, ?) AND updated_at < ? RETURNING trajectory_uid",
                (COMPLETED, ABANDONED, finished_before)).fetchall()]
            self._snapshots.drop(abandoned + removed)
        return abandoned, len(removed)

    def bytes_in_use(self) -> int:
        """Bytes of the state's pages that hold data (free pages, left by removed rows, not counted)."""
        with self._lock:
            self._commits.commit()
            pages = self._db.execute("PRAGMA page_count").fetchone()[0]
            free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
            size = self._db.execute("PRAGMA page_size").fetchone()[0]
        return (pages - free) * size

    def unfinished(self) -> list[tuple[str, str, str, float]]:
        """(trajectory_uid, channel, prompt_uid, updated_at) of every trajectory still open or completing."""
        with self._lock:
            self._commits.commit()
            return self._db.execute("SELECT trajectory_uid, channel, prompt_uid, updated_at FROM trajectories "
                                    "WHERE status IN (?, ?)", (OPEN, COMPLETING)).fetchall()

    def counts(self) -> dict[str, int]:
        with self._lock:
            self._commits.commit()
            rows = self._db.execute("SELECT status, COUNT(*) FROM trajectories GROUP BY status").fetchall()
        return {status: count for status, count in rows}

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._checkpointer.close()
        with self._lock:
            self._commits.commit()
            if not self._lost_commits:  # every index taken is on disk: the next gateway skips none
                self._db.execute("UPDATE trajectories SET reserved_steps = next_step WHERE reserved_steps > next_step")
            self._db.close()
        log.info("trajectory state closed path=%s changes=%d commits=%d", self.path, self._commits.changes,
                 self._commits.commits)
