"""Keeps the trajectory state bounded: ``TrajectoryStore.sweep`` on a timer, its size a metric."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time

from trajbus.gateway.config import GatewaySettings
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.state.trajectories import ABANDONED, COMPLETED, COMPLETING, OPEN, TrajectoryStore

log = logging.getLogger("trajbus.gateway")


class StateSweeper:
    """Abandons idle trajectories and removes finished ones, off the event loop, a few times per timeout."""

    def __init__(self, settings: GatewaySettings, store: TrajectoryStore, metrics: GatewayMetrics) -> None:
        self.settings, self.store, self.metrics = settings, store, metrics
        self.interval = max(0.1, min(10.0, settings.idle_timeout / 4, settings.finished_retention / 4))
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sweep_once)
            except sqlite3.Error as exc:  # a full disk, say: the gateway keeps serving, the next sweep retries
                log.warning("trajectory state sweep failed: %s", exc)
            await asyncio.sleep(self.interval)

    def sweep_once(self) -> None:
        now = time.time()
        abandoned, removed = self.store.sweep(now - self.settings.idle_timeout, now - self.settings.finished_retention)
        if abandoned:  # the admission's own idle rule has dropped them already
            self.metrics.trajectories.labels("abandoned").inc(len(abandoned))
        if abandoned or removed:
            log.info("trajectory state swept abandoned=%d removed=%d", len(abandoned), removed)
        counts = self.store.counts()
        for status in (OPEN, COMPLETING, COMPLETED, ABANDONED):
            self.metrics.state_trajectories.labels(status).set(counts.get(status, 0))
        self.metrics.state_bytes.set(self.store.bytes_in_use())
