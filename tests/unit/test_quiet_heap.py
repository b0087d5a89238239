"""When the gateway collects fully and gives its free heap back (``gateway.http.quiet``): once no call is in flight,
at most every ``min_seconds``, never while calls are in flight."""

import asyncio
import threading
import time

from prometheus_client import CollectorRegistry, Counter

from trajbus.gateway.http.quiet import QuietUpkeep
from trajbus.infra.collector import CollectionPacer

INTERVAL = 0.3


class Releases:
    """The release the rule calls, on its worker thread: counted, and whether a call was in flight then; and the
    full collections its pacer was asked for."""

    def __init__(self) -> None:
        self.count, self.while_busy, self.busy, self.full = 0, 0, False, 0
        self._lock = threading.Lock()

    def collect(self, generation: int) -> int:
        with self._lock:
            self.full += generation == 2
        return 0

    def freeze(self) -> None:
        pass

    def unfreeze(self) -> None:
        pass

    def __call__(self) -> bool:
        with self._lock:
            self.count += 1
            self.while_busy += self.busy
        return True


async def until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def rule(releases: Releases, release_on_loop=None) -> QuietUpkeep:
    counter = Counter("releases", "releases", registry=CollectorRegistry())
    pacer = CollectionPacer(full_seconds=3600, heap=releases)
    return QuietUpkeep(counter, release=releases, min_seconds=INTERVAL, pacer=pacer, release_on_loop=release_on_loop)


def test_quiet_releases_at_once_then_at_most_once_per_interval_and_only_while_quiet() -> None:
    async def scenario() -> None:
        releases = Releases()
        heap = rule(releases)
        heap.busy()
        heap.quiet()  # the first quiet moment: released at once
        await until(lambda: releases.count == 1 and heap._running is None)
        started = time.monotonic()
        for _ in range(3):  # quiet again within the interval: one release, when the interval ends
            heap.busy()
            heap.quiet()
        await until(lambda: releases.count == 2)
        assert time.monotonic() - started >= INTERVAL * 0.9
        await until(lambda: heap._running is None)

        heap.busy()
        heap.quiet()  # due at the interval's end...
        heap.busy()  # ...but calls are in flight again by then: no release
        releases.busy = True
        await until(lambda: heap._due is None)
        assert releases.count == 2
        releases.busy = False
        heap.quiet()  # the next quiet moment after the interval: released
        await until(lambda: releases.count == 3)
        assert releases.while_busy == 0
        assert releases.full == 0  # none was due: the heap released without a walk of every object
        heap.close()

    asyncio.run(scenario())


def test_a_quiet_moment_runs_the_full_collection_due_before_the_release() -> None:
    async def scenario() -> None:
        releases = Releases()
        heap = rule(releases)
        heap.busy()
        heap.quiet()  # before full_seconds passed: released, no full collection
        await until(lambda: releases.count == 1 and heap._running is None)
        assert releases.full == 0
        heap.pacer.last_full -= heap.pacer.full_seconds  # full_seconds since the last one, without waiting them
        assert heap.pacer.full_due()
        heap.busy()
        heap.quiet()  # due now: collected fully, then released
        await until(lambda: releases.count == 2 and heap._running is None)
        assert releases.full == 1
        heap.close()

    asyncio.run(scenario())


def test_a_release_due_is_cancelled_by_close() -> None:
    async def scenario() -> None:
        releases = Releases()
        heap = rule(releases)
        heap.quiet()
        await until(lambda: releases.count == 1 and heap._running is None)
        heap.quiet()  # within the interval: due at its end
        due = heap._due
        assert due is not None
        heap.close()
        assert due.cancelled() and heap._due is None
        heap.quiet()  # closed: nothing begins
        assert heap._due is None and heap._running is None

    asyncio.run(scenario())


def test_the_loops_own_heap_is_released_on_the_loop_after_the_workers_part_only_while_still_quiet() -> None:
    async def scenario() -> None:
        releases, on_loop = Releases(), []
        heap = rule(releases, lambda: on_loop.append((threading.current_thread(), releases.count)) or True)
        heap.quiet()
        await until(lambda: releases.count == 1 and heap._running is None)
        assert on_loop == [(threading.current_thread(), 1)]  # the loop's thread, after the worker's release
        await asyncio.sleep(INTERVAL)
        heap.quiet()  # released on the worker...
        heap.busy()  # ...while a call arrived: the loop, busy again, is not held for its own heap
        await until(lambda: releases.count == 2 and heap._running is None)
        assert len(on_loop) == 1
        heap.close()

    asyncio.run(scenario())
