"""How the trajectory state reaches the disk: calls' changes committed together, the WAL copied apart.

A SQLite commit costs about 30 us whatever it holds (the WAL frames of the pages it touched), a call's own
statements about 15 us, and every call makes two changes (its step indices, then what it published). So the
changes of the calls in flight are queued and committed together (``GroupCommit``): the first caller to wait
for its batch schedules one commit on the event loop's next turn, and every change queued until then rides in
it. One call in flight waits no longer than before; hundreds share a commit. A caller still awaits the commit
of what it queued, so the state is durable before the gateway acts on it, as with a commit per change.

The WAL is copied into the database on a thread of its own (``Checkpointer``), never in a call's commit.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

log = logging.getLogger("trajbus.gateway")
CHECKPOINT_SECONDS = 1.0
"""How often the checkpointer copies committed pages from the WAL into the database (never in a call's commit)."""


class Batch:
    """Statements committed in one transaction, and who waits for them."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, tuple]] = []
        self.trajectory_uids: set[str] = set()
        self.done: asyncio.Future | None = None
        """Created by the first waiter, on the event loop; resolved when the batch is committed or failed."""
        self.committed = False
        self.error: BaseException | None = None


class GroupCommit:
    """Queues changes and commits them in batches over the store's connection, under the store's lock."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock, writer: ThreadPoolExecutor,
                 on_failure: Callable[[set[str]], None]) -> None:
        """``on_failure``: called (lock held) with the trajectories of a batch that failed to commit, whose
        in-memory state is ahead of the disk's."""
        self._db, self._lock, self._writer, self._on_failure = db, lock, writer, on_failure
        self._open: Batch | None = None
        self._guard = threading.Lock()
        """Guards a batch's ``done`` and ``committed`` between the loop's waiters and a commit on another thread."""
        self.commits = 0
        self.changes = 0

    def queue(self, trajectory_uid: str, *statements: tuple[str, tuple]) -> None:
        """Queue one change's statements (the store's lock held); committed with the open batch, which its
        caller awaits (``changes`` counts them)."""
        self.defer(trajectory_uid, *statements)
        self.changes += 1

    def defer(self, trajectory_uid: str, *statements: tuple[str, tuple]) -> None:
        """Queue statements nobody awaits (the store's lock held): committed with the next batch (an awaited
        change's, a read's, the close's), or lost with the process, which their caller allows for."""
        if self._open is None:
            self._open = Batch()
        self._open.statements.extend(statements)
        self._open.trajectory_uids.add(trajectory_uid)

    def open_batch(self) -> Batch | None:
        """The batch the changes queued since the last commit are in (read with the store's lock held)."""
        return self._open

    async def wait(self, batch: Batch) -> None:
        """Until ``batch`` is committed (scheduling its commit on the loop's next turn); its error, if it failed."""
        with self._guard:
            if not batch.committed and batch.done is None:
                loop = asyncio.get_running_loop()
                batch.done = loop.create_future()
                loop.call_soon(self._commit_soon)
            done = batch.done
        if done is not None:
            await asyncio.shield(done)  # a cancelled caller leaves the batch to commit for the others
        if batch.error is not None:
            raise batch.error

    def _commit_soon(self) -> None:
        """On the loop: in place when the connection is free, else on the writer thread (a sweep holds it)."""
        if self._lock.acquire(blocking=False):
            try:
                self.commit()
            finally:
                self._lock.release()
        else:
            asyncio.get_running_loop().run_in_executor(self._writer, self._commit_locked)

    def _commit_locked(self) -> None:
        with self._lock:
            self.commit()

    def commit(self) -> None:
        """Commit the open batch (the store's lock held): before any other use of the connection, so the
        table is never read behind the memory or changed out of order."""
        batch, self._open = self._open, None
        if batch is None:
            return
        try:
            self._db.execute("BEGIN")
            for sql, params in batch.statements:
                self._db.execute(sql, params)
            self._db.execute("COMMIT")
            self.commits += 1
        except sqlite3.Error as exc:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            log.error("trajectory state not committed trajectories=%d error=%s", len(batch.trajectory_uids), exc)
            batch.error = exc
            self._on_failure(batch.trajectory_uids)
        self._settle(batch)

    def _settle(self, batch: Batch) -> None:
        with self._guard:
            batch.committed = True
            done = batch.done
        if done is None:
            return
        loop = done.get_loop()
        if _running_loop() is loop:
            _resolve(done)
        else:
            loop.call_soon_threadsafe(_resolve, done)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _resolve(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)  # the batch's error, if any, is raised by each waiter from the batch


class Checkpointer:
    """Copies the WAL into the database every ``CHECKPOINT_SECONDS`` on its own thread and connection (a
    passive checkpoint: writers go on meanwhile), so no commit on the event loop pays for one."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trajectory-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(CHECKPOINT_SECONDS):
            try:
                self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error as exc:  # the next one copies what this one could not
                log.warning("trajectory state checkpoint failed path=%s error=%s", self._path, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._db.close()
