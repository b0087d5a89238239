"""The gateway's memory upkeep, paced by its calls in flight: what the calls allocated frozen every 0.1 s while
calls run (``infra.collector.CollectionPacer``), and once the instance goes quiet (no engine call in flight) the C
allocator's free heap given back to the OS, after a full collection when one is due.

A burst of calls (thousands in flight at once at 32k-token contexts) leaves the gateway's heap holding what the
calls freed: request bodies, messages, prompts, freed between the trajectories' state that outlives them. glibc
returns a heap's pages only from its top, so after a burst the instance kept about as much free heap as its
trajectories hold (``benchmarks.fleet_bench`` at 1,024 agents: 204 MB free beside 184 MB in use).
``infra.allocator.release_free_heap`` returns them, but holds each heap's lock while it walks it (10-150 ms at a
few hundred MB): it runs on a worker thread and begins only when no call is in flight (the end of a rollout
phase, when an RL trainer takes over), so only a call arriving meanwhile may wait for it; at most every
``MIN_SECONDS``, it cost nothing measurable in ``benchmarks.gateway_bench`` (the pages a later burst touches are
mapped again). Under mimalloc (``infra.allocator``) each thread's heap is collected only by its owner, so the
event loop's own free pages are given back on the loop, once the worker's part is done, if still quiet.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import Callable

from prometheus_client import Counter

from trajbus.infra.allocator import mimalloc_active, release_free_heap, release_thread_heap
from trajbus.infra.collector import CollectionPacer

log = logging.getLogger("trajbus.gateway")
MIN_SECONDS = 10.0
"""The least time between two releases: at one agent the instance goes quiet after every call."""
LOGGED_BYTES = 16 * 2**20
"""A release that returned less (a few MB, at a handful of agents) is logged at DEBUG only."""


def _rss() -> int:
    """This process's resident bytes (0 where ``/proc`` is absent: the release is glibc's, Linux's, anyway)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _logged(what: str, release: Callable[[], object]) -> None:
    """Run ``release`` and log what it gave back (at INFO from ``LOGGED_BYTES``), with its own words when it
    returns a string."""
    before, started = _rss(), time.perf_counter()
    said = release()
    after = _rss()
    log.log(logging.INFO if before - after >= LOGGED_BYTES else logging.DEBUG,
            "%s %srss_mb_before=%.0f rss_mb_after=%.0f took_ms=%.1f", what, f"{said} " if isinstance(said, str) else "",
            before / 2**20, after / 2**20, 1000 * (time.perf_counter() - started))


class QuietUpkeep:
    """Told when the instance's calls in flight go from none to some (``busy``) and back (``quiet``); paces the
    collector while busy, and once quiet, on a worker thread, runs a full collection when one is due
    (``CollectionPacer.full_due``) and releases the free heap, at most every ``min_seconds`` (a quiet moment
    sooner than that releases when the interval ends, if still quiet then). Lives on the event loop."""

    def __init__(self, releases: Counter, release: Callable[[], bool] = release_free_heap,
                 min_seconds: float = MIN_SECONDS, pacer: CollectionPacer | None = None,
                 release_on_loop: Callable[[], bool] | None = None) -> None:
        """``release_on_loop``: the part of the release only the loop's thread can do (default: mimalloc's
        collection of its own heap, under mimalloc; none under glibc, whose release walks every heap)."""
        self.releases, self.release, self.min_seconds = releases, release, min_seconds
        self.release_on_loop = release_on_loop or (release_thread_heap if mimalloc_active() else None)
        self.pacer = pacer or CollectionPacer()
        self._quiet = True
        self._last = -math.inf
        self._due: asyncio.TimerHandle | None = None
        self._running: asyncio.Future | None = None
        self._closed = False

    def busy(self) -> None:
        self._quiet = False
        self.pacer.busy()

    def quiet(self) -> None:
        self._quiet = True
        self.pacer.quiet()
        if self._closed or self._due is not None or self._running is not None:
            return  # one is on its way; calls freed after it began wait for the next quiet moment
        loop = asyncio.get_running_loop()
        wait = self._last + self.min_seconds - loop.time()  # the loop's clock: the one ``call_later`` keeps
        if wait > 0:
            self._due = loop.call_later(wait, self._when_due)
        else:
            self._start()

    def _when_due(self) -> None:
        self._due = None
        if self._quiet:
            self._start()

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        self._running = loop.run_in_executor(None, self._release)
        self._running.add_done_callback(self._finished)

    def _finished(self, future: asyncio.Future) -> None:
        self._running = None
        if not future.cancelled() and future.exception() is not None:
            log.warning("free heap not released error=%r", future.exception())
        elif self.release_on_loop is not None and self._quiet and not self._closed:
            _logged("event loop's heap released to the OS", self.release_on_loop)

    def _release(self) -> None:
        """On a worker thread: the full collection when due (what it frees is released too), the release, counted,
        and logged."""
        def collect_and_release() -> str:
            collected = self.pacer.full_due()
            if collected:
                self.pacer.full()
            self.release()
            self.releases.inc()
            return f"full_collection={collected}"

        _logged("free heap released to the OS", collect_and_release)

    def close(self) -> None:
        """No release or collection begins after this (one running ends on its own thread)."""
        self._closed = True
        self.pacer.close()
        if self._due is not None:
            self._due.cancel()
            self._due = None
