"""Python's cycle collector, set for a long-running server whose calls each keep a few hundred objects alive.

CPython collects a generation once the objects it tracks grew by its threshold, counting allocations less
deallocations. In a server that count barely moves: every call allocates its objects (coroutines, frames' cells,
requests, messages) and frees those of a call that ended, so the young generation grows with the calls in flight
while its count stays under the threshold. Measured in the gateway in front of a paced engine
(``benchmarks.paced_bench``, 256 calls of 5 s in flight, a ``gc.callbacks`` probe): at thresholds (20,000, 10, 10)
a young collection came every ~10 s and walked 54-66k objects, 20-30 ms (up to 121 ms on a busy machine) with
every call waiting; at (2,000, 3, ...) still 22-58k, up to 64 ms. Most of those objects belong to calls in flight
and none is garbage (the collections found 0).

So the server paces its own collections (``CollectionPacer``): while calls are in flight, every
``TICK_SECONDS`` on the event loop it collects the young and middle generations together, which walks what was
allocated since the last tick once and moves what is still alive to the old generation. A pause then follows the
calls' rate over one tick, not all the calls in flight (under 10 ms at 256 paced calls), and an object of a call
is walked once, not once per generation. Full collections walk every object of every call in flight and every
open trajectory, so they run when no call is in flight (``gateway.http.quiet``), and while calls never stop, at
most every ``FULL_SECONDS``. The thresholds stay as a net for a burst that allocates faster than the ticks.
Freezing the objects built before serving (about 140k: the tokenizer, transformers, the app) keeps full
collections off them.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Callable

from trajbus.infra.allocator import return_large_blocks

SERVING_THRESHOLDS = (10_000, 3, 1_000_000_000)
"""A young collection once 10,000 objects more are alive (a burst's thousands of arriving calls, between two
ticks), a middle one every fourth, and a full one never of its own accord (``CollectionPacer`` runs them)."""
TICK_SECONDS = 0.1
FULL_SECONDS = 600.0
"""The longest an instance whose calls never stop goes without a full collection (the cycles freed in its old
generation wait that long; measured, a gateway makes almost none): the gateway's ``--full-collection-every``."""


def tune_for_serving() -> None:
    """Call once the server's long-lived state is built, before it takes calls. The C allocator is set for
    serving too (``infra.allocator``): the calls' large buffers go back to the OS when freed."""
    return_large_blocks()
    gc.collect()  # what startup left as garbage is not frozen with the rest
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)


def freeze_loaded() -> None:
    """Call once long-lived state that loads after ``tune_for_serving`` is built (the gateway's tokenizer loads
    in a thread while the server already answers ``/ready``): full collections then skip it too. Without it,
    every full collection walks the tokenizer's tens of thousands of objects again."""
    gc.freeze()


class CollectionPacer:
    """The young and middle generations collected on the event loop's clock while the server is ``busy``, and all
    of them at most every ``full_seconds`` of it; nothing while it is quiet (``full`` is then called by its
    owner)."""

    def __init__(self, tick_seconds: float = TICK_SECONDS, full_seconds: float = FULL_SECONDS,
                 collect: Callable[[int], int] = gc.collect) -> None:
        self.tick_seconds, self.full_seconds, self.collect = tick_seconds, full_seconds, collect
        self.last_full = time.monotonic()
        self._busy = self._closed = False
        self._due: asyncio.TimerHandle | None = None

    def busy(self) -> None:
        self._busy = True
        if self._due is None and not self._closed:
            self._due = asyncio.get_running_loop().call_later(self.tick_seconds, self._tick)

    def quiet(self) -> None:
        self._busy = False  # the tick due finds it so and stops

    def full(self) -> None:
        """A full collection now (thread-safe: CPython runs one collection at a time, the others return 0)."""
        self.collect(2)
        self.last_full = time.monotonic()

    def _tick(self) -> None:
        self._due = None
        if not self._busy or self._closed:
            return
        if time.monotonic() - self.last_full >= self.full_seconds:
            self.full()
        else:
            self.collect(1)
        self._due = asyncio.get_running_loop().call_later(self.tick_seconds, self._tick)

    def close(self) -> None:
        self._closed = True
        if self._due is not None:
            self._due.cancel()
            self._due = None
