"""A watch on Faust's table recovery: a recovery that receives nothing is started again.

After a rebalance, faust-streaming 0.15 resumes the changelog partitions and waits for
their events until it reaches their high watermarks. It has been seen to wait forever:
"No event received for active tp ... since recovery start" on every changelog partition
for minutes, no error on the fetch path, and no assembly meanwhile (twice in CI, in
``test_two_workers_on_8_partitions_one_killed``, cause unknown). Faust only warns. The
watch starts such a recovery again the way a new rebalance does (``signal_recovery_start``:
offsets read and sought, partitions and the fetcher resumed anew), once per stalled start.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import faust

log = logging.getLogger("trajbus.worker")

STALL_SECONDS = 30.0
"""No changelog event at all this long after a recovery started: it is stalled. A recovery with
records to read gets its first events within a fetch or two."""


class RecoveryWatch:
    """Checks a Faust ``Recovery`` (``app.tables.recovery``) from a timer."""

    def __init__(self, recovery: Any, stall_seconds: float = STALL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.recovery, self.stall_seconds, self.clock = recovery, stall_seconds, clock
        self._restarted_for: float | None = None
        self.restarts = 0

    def check(self) -> bool:
        """Restart the recovery if it stalled; returns whether it did."""
        started = getattr(self.recovery, "_recovery_started_at", None)
        received = getattr(self.recovery, "_active_events_received_at", None)
        if not self.recovery.in_recovery or started is None or received:
            return False
        if self.clock() - started < self.stall_seconds or self._restarted_for == started:
            return False
        self._restarted_for = started
        self.restarts += 1
        log.warning("table recovery received no changelog event in %.0fs since it started: starting it again",
                    self.clock() - started)
        self.recovery.signal_recovery_start.set()
        return True


def watch_recovery(app: faust.App, every: float = 5.0) -> RecoveryWatch:
    """A watch over ``app``'s table recovery, checked every ``every`` seconds."""
    watch = RecoveryWatch(app.tables.recovery)

    @app.timer(every)
    async def check_recovery() -> None:
        watch.check()

    return watch
