"""The trajectories in use, held in memory: a bounded, thread-safe cache of immutable snapshots."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Generic, TypeVar

from cachetools import LRUCache

S = TypeVar("S")
"""A trajectory's dataclass (``gateway.state.trajectories.Trajectory``), keyed by its ``trajectory_uid``."""


class Snapshots(Generic[S]):
    """The trajectories in use, in memory, the least recently used dropped first (``cachetools``). A snapshot
    is never changed in place: a change replaces it whole, so a reader on another thread never sees half of one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: LRUCache[str, S] = LRUCache(size)
        self._lock = threading.Lock()

    def get(self, trajectory_uid: str) -> S | None:
        with self._lock:
            return self._items.get(trajectory_uid)

    def put(self, trajectory: S) -> None:
        with self._lock:
            self._items[trajectory.trajectory_uid] = trajectory

    def change(self, trajectory_uid: str, **changes: Any) -> None:
        with self._lock:
            trajectory = self._items.get(trajectory_uid)
            if trajectory is not None:
                self._items[trajectory_uid] = dataclasses.replace(trajectory, **changes)

    def drop(self, trajectory_uids: list[str]) -> None:
        with self._lock:
            for uid in trajectory_uids:
                self._items.pop(uid, None)
