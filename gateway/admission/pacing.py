"""Pacing of new trajectories: ``gateway.admission.rules``'s rules fed by ``gateway.admission.backlog``'s signals.

Every gateway instance reads the same backlog from Kafka and announces its own
in-flight groups there under its instance id, so a fleet of gateways shares one
bound with no coordinator. A restarted instance takes its id back: its new
announcement replaces the old one instead of being counted beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

from trajbus.gateway.admission.backlog import BacklogMonitor
from trajbus.gateway.admission.rules import Admission
from trajbus.gateway.config import GatewaySettings
from trajbus.gateway.errors import bad_request
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.streams.wire.stats import gateway_key

BACKLOG_KINDS = ("ready", "in_flight_here", "in_flight_elsewhere")


class Pacing:
    """Admits, holds or refuses new trajectories; counts this instance's in flight for the fleet."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics,
                 start_version: Callable[[str], int | None], trainer_version: Callable[[str], int | None]) -> None:
        self.settings, self.metrics = settings, metrics
        self.admission = Admission(settings.admission, settings.admission_by_channel, settings.idle_timeout, metrics)
        self._start_version, self._trainer_version = start_version, trainer_version
        self.backlog: BacklogMonitor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def active(self) -> bool:
        return self.admission.active

    def start(self, unfinished: list[tuple[str, str, str, float]]) -> None:
        """On the event loop: the trajectories admitted before a restart count again."""
        self._loop = asyncio.get_running_loop()
        for uid, channel, prompt_uid, updated_at in unfinished:
            self.admission.add(uid, channel, prompt_uid, updated_at)

    def watch(self, servers: str) -> None:
        """Start reading the backlog (from the Kafka link's thread, once connected); no-op when pacing is off."""
        if not self.active:
            return
        backlog = BacklogMonitor(servers, self.settings.prefix, gateway_key(self.settings.instance),
                                 self.admission.in_flight,
                                 lambda: self._loop.call_soon_threadsafe(self._refreshed))
        backlog.watch(self.settings.default_channel)
        self.admission.ready, self.admission.elsewhere = backlog.ready, backlog.elsewhere
        self.backlog = backlog  # before its first refresh can reach the loop
        backlog.start()

    def _refreshed(self) -> None:
        """On the event loop, after each read of the signals: gauges, then held trajectories decide again."""
        for channel in self.backlog.channels():
            backlog = self.admission.backlog(channel)
            if backlog is not None:
                for kind in BACKLOG_KINDS:
                    self.metrics.backlog.labels(channel, kind).set(getattr(backlog, kind))
        self.admission.wake()

    async def admit(self, trajectory_uid: str, channel: str, prompt_uid: str, declared_version: int | None,
                    wait: float) -> None:
        """Admit a new trajectory or answer 429 (see ``gateway.admission.rules``); no-op when pacing is off."""
        if not self.active:
            return
        if wait > self.settings.max_admission_wait:
            raise bad_request(f"wait: at most {self.settings.max_admission_wait:g} seconds "
                              f"(--max-admission-wait), got {wait:g}", param="wait")
        start = (lambda: declared_version) if declared_version is not None else (
            lambda: self._start_version(channel))
        await self.admission.admit(trajectory_uid, channel, prompt_uid, start,
                                   lambda: self._trainer_version(channel), wait)

    def admitted(self, trajectory_uid: str) -> bool:
        return trajectory_uid in self.admission.admitted

    def touch(self, trajectory_uid: str) -> None:
        self.admission.touch(trajectory_uid)

    def release(self, trajectory_uid: str) -> None:
        self.admission.release(trajectory_uid)

    def state(self) -> dict[str, dict[str, Any]]:
        """Per channel watched: the limits and the backlog as this gateway sees it (None: not read yet)."""
        state = {}
        for channel in self.backlog.channels() if self.backlog is not None else []:
            rules, backlog = self.admission.rules(channel), self.admission.backlog(channel)
            state[channel] = {**dataclasses.asdict(rules), "backlog": None if backlog is None else
                              {**dataclasses.asdict(backlog), "total": backlog.total}}
        return state

    def close(self) -> None:
        if self.backlog is not None:
            self.backlog.close()
