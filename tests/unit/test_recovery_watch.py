"""The recovery watch restarts a Faust table recovery that received nothing, once per stalled start."""

from __future__ import annotations

import asyncio

from trajbus.streams.worker.table_recovery_watch import RecoveryWatch


class FakeRecovery:
    """The attributes of ``faust.tables.recovery.Recovery`` the watch reads."""

    def __init__(self) -> None:
        self.in_recovery = False
        self._recovery_started_at: float | None = None
        self._active_events_received_at: dict = {}
        self.signal_recovery_start = asyncio.Event()


def test_a_stalled_recovery_is_started_again_once_and_a_live_one_never():
    now = [100.0]
    recovery = FakeRecovery()
    watch = RecoveryWatch(recovery, stall_seconds=30, clock=lambda: now[0])
    assert not watch.check(), "not recovering"
    recovery.in_recovery, recovery._recovery_started_at = True, 100.0
    now[0] = 129.0
    assert not watch.check() and not recovery.signal_recovery_start.is_set(), "not stalled yet"
    now[0] = 131.0
    assert watch.check() and recovery.signal_recovery_start.is_set()
    recovery.signal_recovery_start.clear()
    now[0] = 200.0
    assert not watch.check(), "once per recovery start"
    recovery._recovery_started_at = 190.0  # Faust started it again
    now[0] = 221.0
    assert watch.check() and watch.restarts == 2
    recovery._recovery_started_at, recovery._active_events_received_at = 230.0, {"tp": 231.0}
    now[0] = 400.0
    assert not watch.check(), "events arrive: a slow recovery is left alone"
