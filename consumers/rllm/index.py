"""The rLLM trace store's index: the steps topic folded into what the ``TraceStore`` calls ask.

Pure and single-threaded (the store holds a lock around it): ``consumers.rllm.feed`` applies each
record once, in its partition's order, so building it costs the traces written, once, and a read
costs the traces it returns (a session's are kept sorted), never sessions x traces. It keeps
the live traces only: a deleted incarnation's go at its tombstone, and a trace of it that comes
later (a write racing the delete) is ignored, as trajbus's worker counts it late. A trace that is
no step (``consumers.rllm.kept``) is a trace of its session and incarnation like any other, but it
holds no step index: ``steps`` and ``last`` are the steps the worker sees.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

from trajbus.consumers.rllm.kept import KeptTrace
from trajbus.consumers.rllm.traces import TraceEntry

__all__ = ["Trace", "TraceIndex"]

Trace = TraceEntry | KeptTrace
"""A stored trace: a step on the steps topic, or one kept on the store's own topic."""


def _key(entry: Trace) -> tuple[float, int]:
    return entry.sort_key


class TraceIndex:
    """Live traces by id, by session (sorted by store time) and by incarnation (by step index)."""

    def __init__(self) -> None:
        self._traces: dict[str, Trace] = {}
        self._sessions: dict[str, list[Trace]] = {}
        self._incarnations: dict[str, dict[int, TraceEntry]] = defaultdict(dict)
        self._kept: dict[str, list[KeptTrace]] = defaultdict(list)
        self._ended: set[str] = set()
        self._deleted: set[str] = set()

    # -- the feed's updates ---------------------------------------------------------
    def add(self, entry: Trace) -> bool:
        """Apply a trace read from the topic; False when ignored (its id is known: the first one read
        stands, as the worker keeps a step's first copy; or its incarnation was deleted)."""
        if entry.trace_id in self._traces or entry.trajectory_uid in self._deleted:
            return False
        self._traces[entry.trace_id] = entry
        bisect.insort(self._sessions.setdefault(entry.session_id, []), entry, key=_key)
        if isinstance(entry, KeptTrace):
            self._kept[entry.trajectory_uid].append(entry)
        else:
            self._incarnations[entry.trajectory_uid][entry.step_index] = entry
        return True

    def end(self, trajectory_uid: str) -> None:
        """The incarnation was ended (``end_session``): the session's next trace starts a new one."""
        if trajectory_uid in self._incarnations or trajectory_uid in self._kept:
            self._ended.add(trajectory_uid)

    def delete(self, session_id: str, trajectory_uid: str) -> int:
        """A tombstone: the incarnation's traces go; returns how many."""
        self._deleted.add(trajectory_uid)
        self._ended.discard(trajectory_uid)
        gone = [*self._incarnations.pop(trajectory_uid, {}).values(), *self._kept.pop(trajectory_uid, [])]
        if not gone:
            return 0
        for entry in gone:
            del self._traces[entry.trace_id]
        kept = [entry for entry in self._sessions.get(session_id, []) if entry.trajectory_uid != trajectory_uid]
        if kept:
            self._sessions[session_id] = kept
        else:
            self._sessions.pop(session_id, None)
        return len(gone)

    # -- reads ------------------------------------------------------------------------
    def get(self, trace_id: str) -> Trace | None:
        return self._traces.get(trace_id)

    def size(self) -> tuple[int, int]:
        """(sessions, traces) live."""
        return len(self._sessions), len(self._traces)

    def session_traces(self, session_id: str, since: float | None = None, limit: int | None = None
                       ) -> list[Trace]:
        """A session's traces stored at or after ``since``, oldest first, at most ``limit``."""
        entries = self._sessions.get(session_id, [])
        start = 0 if since is None else bisect.bisect_left(entries, since, key=lambda e: e.created_at)
        stop = len(entries) if limit is None else min(len(entries), start + limit)
        return entries[start:stop]

    def sessions(self, since: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Sessions with their trace counts (traces stored at or after ``since``), newest first session first."""
        found = []
        for session_id in self._sessions:
            entries = self.session_traces(session_id, since)
            if entries:
                found.append({"session_id": session_id, "trace_count": len(entries),
                              "first_trace_at": entries[0].created_at, "last_trace_at": entries[-1].created_at})
        found.sort(key=lambda row: row["first_trace_at"], reverse=True)
        return found if limit is None else found[:limit]

    def incarnations(self, session_id: str) -> list[str]:
        """The session's incarnations that hold live traces, in order of their first trace."""
        return list(dict.fromkeys(entry.trajectory_uid for entry in self._sessions.get(session_id, [])))

    def steps(self, trajectory_uid: str) -> list[int]:
        """The step indices of an incarnation's live steps (its kept traces hold none)."""
        return sorted(self._incarnations.get(trajectory_uid, {}))

    def last(self, trajectory_uid: str) -> TraceEntry | None:
        """An incarnation's step of the highest step index."""
        steps = self._incarnations.get(trajectory_uid)
        return steps[max(steps)] if steps else None

    def open_incarnation(self, session_id: str) -> str | None:
        """The incarnation the session's next trace continues: its newest trace's, unless that one was ended."""
        entries = self._sessions.get(session_id)
        if not entries or entries[-1].trajectory_uid in self._ended:
            return None
        return entries[-1].trajectory_uid
