"""The worker's periodic jobs: each one a loop that waits its interval after a run ends.

Faust's ``app.timer(interval)`` awaits its function and warns ``Timer ... is overlapping``
whenever one run outlasts the interval. The worker's tick waits on Kafka: on a fresh assignment
it reconciles every partition against the groups topics (1.3 s for two channels of 8 partitions,
hence the warning in a worker's first seconds), and while a broker is away a look-up waits out
its timeout. No run ever started before the last one ended; a slow one only came late. So a job
here sleeps its interval *between* runs (an app task, started as Faust starts its timers, once
the tables are recovered): a slow run delays the next one, and nothing overlaps. A failed run is
tried again at the next one; its failures are told once per streak (``FailureStreak``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import faust

from trajbus.streams.worker.logs import FailureStreak

log = logging.getLogger("trajbus.worker")


async def run_once(job: Callable[[], Awaitable[None]], streak: FailureStreak) -> bool:
    """One run of ``job``; returns whether it succeeded (a failure goes to ``streak``)."""
    try:
        await job()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - tried again at the next run; assembly goes on
        streak.failed(exc)
        return False
    streak.succeeded()
    return True


def every(app: faust.App, interval: float, job: Callable[[], Awaitable[None]], what: str) -> FailureStreak:
    """Run ``job`` every ``interval`` seconds after its last run ended, until ``app`` stops; ``what``
    names it in the lines of a failure streak."""
    streak = FailureStreak(what, log)

    async def loop() -> None:
        while not app.should_stop:
            await app.sleep(interval)  # returns at once when the app stops
            if not app.should_stop:
                await run_once(job, streak)

    app.task(loop)
    return streak
