"""Python's cycle collector, set for a long-running server whose calls each keep a few hundred objects alive.

CPython collects a generation once the objects it tracks grew by its threshold, counting allocations less
deallocations. In a server that count barely moves: every call allocates its objects (coroutines, frames' cells,
requests, messages) and frees those of a call that ended, so the young generation grows with the calls in flight
while its count stays under the threshold. Measured in the gateway in front of a paced engine
(``benchmarks.paced_bench``, 256 calls of 5 s in flight, a ``gc.callbacks`` probe): at thresholds (20,000, 10, 10)
a young collection came every ~10 s and walked 54-66k objects, 20-30 ms (up to 121 ms on a busy machine) with
every call waiting; at (2,000, 3, ...) still 22-58k, up to 64 ms. Most of those objects belong to calls in flight
and none is garbage (the collections found 0).

So the server paces its own collections (``CollectionPacer``): while calls are in flight, every ``TICK_SECONDS`` on
the event loop it freezes what was allocated since the last tick (``gc.freeze``: the young, middle and old lists
spliced onto the permanent one, O(1), no object walked). No tick walks the calls in flight, and an automatic young
collection walks at most what arrived since the last tick: before, a tick collected the young and middle
generations, which walked every object a call in flight had allocated since the last tick, about 250 a call (its
coroutines, closures, messages), at about 0.27 us each: 1.4-1.8 ms a tick at 32 agents, 0.07-0.09 ms of every call's
CPU (0.37 ms at 4,096 agents), and those collections found 9 objects of cyclic garbage in 7,700 calls. Objects in
the permanent generation are still freed by their reference counts the moment a call drops them; only cyclic garbage
waits for a full collection, which unfreezes everything, collects it all and freezes what is left. A full collection
walks every object of the process (the startup's: the tokenizer, transformers, the app; every call in flight; every
open trajectory), 90-170 ms beside 256 agents' trajectories, so it runs at most every ``FULL_SECONDS``: on a worker
thread once no call is in flight (``gateway.http.quiet``), else on the loop. The thresholds stay as a net for a
burst that allocates faster than the ticks.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Protocol

from trajbus.infra.allocator import return_large_blocks

SERVING_THRESHOLDS = (10_000, 3, 1_000_000_000)
"""A young collection once 10,000 objects more are alive (a burst's thousands of arriving calls, between two
ticks), a middle one every fourth, and a full one never of its own accord (``CollectionPacer`` runs them)."""
TICK_SECONDS = 0.1
FULL_SECONDS = 600.0
"""The longest an instance goes without a full collection (the cyclic garbage its calls leave waits that long;
measured, a gateway makes almost none): the gateway's ``--full-collection-every``."""


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


class Heap(Protocol):
    """What the pacer asks of the collector (the ``gc`` module; a test's record of the calls)."""

    def collect(self, generation: int) -> int: ...

    def freeze(self) -> None: ...

    def unfreeze(self) -> None: ...


class CollectionPacer:
    """What the calls allocated frozen on the event loop's clock while the server is ``busy``, and everything
    collected at most every ``full_seconds`` of it; nothing while it is quiet (``full`` is then called by its
    owner)."""

    def __init__(self, tick_seconds: float = TICK_SECONDS, full_seconds: float = FULL_SECONDS,
                 heap: Heap = gc) -> None:
        self.tick_seconds, self.full_seconds, self.heap = tick_seconds, full_seconds, heap
        self.last_full = time.monotonic()
        self._busy = self._closed = False
        self._due: asyncio.TimerHandle | None = None
        self._full = threading.Lock()
        """Held by a full collection (it may run on a worker thread): a tick then leaves the heap as it is."""

    def busy(self) -> None:
        self._busy = True
        if self._due is None and not self._closed:
            self._due = asyncio.get_running_loop().call_later(self.tick_seconds, self._tick)

    def quiet(self) -> None:
        self._busy = False  # the tick due finds it so and stops

    def full_due(self) -> bool:
        """Whether ``full_seconds`` passed since the last full collection: cyclic garbage waits no longer."""
        return time.monotonic() - self.last_full >= self.full_seconds

    def full(self) -> None:
        """Every object collected, the frozen ones too, then what is left frozen again (thread-safe)."""
        with self._full:
            self.heap.unfreeze()
            try:
                self.heap.collect(2)
            finally:
                self.heap.freeze()
        self.last_full = time.monotonic()

    def _tick(self) -> None:
        self._due = None
        if not self._busy or self._closed:
            return
        if self.full_due():
            self.full()
        elif self._full.acquire(blocking=False):
            try:
                self.heap.freeze()
            finally:
                self._full.release()
        self._due = asyncio.get_running_loop().call_later(self.tick_seconds, self._tick)

    def close(self) -> None:
        self._closed = True
        if self._due is not None:
            self._due.cancel()
            self._due = None
