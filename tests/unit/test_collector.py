"""The serving collector settings (``infra.collector``), in a fresh interpreter: the test process keeps its own."""

import asyncio
import subprocess
import sys
import time

from trajbus.infra.collector import CollectionPacer

PROBE = """
import gc, weakref
from trajbus.infra.collector import SERVING_THRESHOLDS, tune_for_serving
tune_for_serving()
print(gc.get_threshold() == SERVING_THRESHOLDS, gc.get_freeze_count() > 1000)
collected = [0]
class Node:
    pass
def count():
    collected[0] += 1
for _ in range(100_000):  # cycles only the collector frees, as asyncio's tasks and exceptions make
    a, b = Node(), Node()
    a.other, b.other = b, a
    weakref.finalize(a, count)
print(collected[0] > 50_000)
"""


def test_serving_freezes_the_startup_heap_and_still_collects_cycles_without_being_asked() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True", "True"], out.stdout + out.stderr


class Heap:
    """The pacer's collector: what it was asked to do (``freeze``, ``unfreeze``, ``collect 2``), in order, and when."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.times: list[float] = []

    def _record(self, call: str) -> None:
        self.calls.append(call)
        self.times.append(time.monotonic())

    def collect(self, generation: int) -> int:
        self._record(f"collect {generation}")
        return 0

    def freeze(self) -> None:
        self._record("freeze")

    def unfreeze(self) -> None:
        self._record("unfreeze")


async def until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_what_calls_allocated_is_frozen_every_tick_while_busy_and_the_ticks_stop_once_quiet() -> None:
    async def scenario() -> None:
        heap = Heap()
        pacer = CollectionPacer(tick_seconds=0.01, full_seconds=3600, heap=heap)
        pacer.busy()
        pacer.busy()  # already ticking: still one tick at a time
        await until(lambda: len(heap.calls) >= 6)
        pacer.quiet()
        await until(lambda: pacer._due is None)  # the tick due found it quiet: none is scheduled after it
        stopped = len(heap.calls)
        assert set(heap.calls) == {"freeze"}  # no collection walks the calls in flight
        pacer.busy()  # busy again: ticking again
        await until(lambda: len(heap.calls) > stopped)
        pacer.close()
        assert pacer._due is None
        pacer.busy()  # closed: nothing begins
        assert pacer._due is None

    asyncio.run(scenario())


def test_a_busy_instance_still_collects_everything_frozen_every_full_seconds() -> None:
    async def scenario() -> None:
        heap = Heap()
        pacer = CollectionPacer(tick_seconds=0.01, full_seconds=0.1, heap=heap)
        pacer.busy()
        await until(lambda: heap.calls.count("collect 2") >= 2)
        pacer.close()
        first, second = [i for i, call in enumerate(heap.calls) if call == "collect 2"][:2]
        assert heap.calls[first - 1:first + 2] == ["unfreeze", "collect 2", "freeze"]  # the frozen ones too
        assert "freeze" in heap.calls[first + 2:second - 1]  # ticks between them...
        assert heap.times[second] - heap.times[first] >= 0.1  # ...and a full one every full_seconds

    asyncio.run(scenario())


def test_a_tick_leaves_the_heap_alone_while_a_full_collection_runs_on_another_thread() -> None:
    async def scenario() -> None:
        heap = Heap()
        pacer = CollectionPacer(tick_seconds=0.01, full_seconds=3600, heap=heap)
        handles: list = []  # the ticks scheduled, one timer each

        def ticks() -> int:
            if pacer._due is not None and all(handle is not pacer._due for handle in handles):
                handles.append(pacer._due)
            return len(handles)

        with pacer._full:  # as a full collection on the quiet upkeep's worker thread holds it
            pacer.busy()
            await until(lambda: ticks() >= 4)  # three ticks ran meanwhile
            assert heap.calls == []
        await until(lambda: "freeze" in heap.calls)  # released: the next tick freezes
        pacer.close()

    asyncio.run(scenario())


FROZEN_PROBE = """
import gc, weakref
from trajbus.infra.collector import CollectionPacer, tune_for_serving
tune_for_serving()
pacer = CollectionPacer()
freed = []
class Node:
    pass
kept = [Node() for _ in range(1000)]  # a call in flight's objects: frozen, no collection walks them
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle that becomes garbage after the freeze
weakref.finalize(a, freed.append, "cycle")
single = Node()
weakref.finalize(single, freed.append, "plain")
pacer.heap.freeze()  # a tick
frozen = gc.get_freeze_count()
del a, b, single
gc.collect()  # every generation collected: the frozen cycle is in none of them
print("plain" in freed, "cycle" not in freed, gc.get_freeze_count() < frozen)
pacer.full()
print("cycle" in freed, gc.get_freeze_count() > 1000)  # the rest frozen again
"""


def test_frozen_objects_are_freed_by_reference_counts_at_once_and_their_cycles_by_a_full_collection() -> None:
    out = subprocess.run([sys.executable, "-c", FROZEN_PROBE], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split() == ["True"] * 5, out.stdout + out.stderr
