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


class Collections:
    """The pacer's ``collect``: the generations it was asked for, in order, and when."""

    def __init__(self) -> None:
        self.generations: list[int] = []
        self.times: list[float] = []

    def __call__(self, generation: int) -> int:
        self.generations.append(generation)
        self.times.append(time.monotonic())
        return 0


async def until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_paced_collections_of_the_young_and_middle_generations_run_while_busy_and_stop_once_quiet() -> None:
    async def scenario() -> None:
        collections = Collections()
        pacer = CollectionPacer(tick_seconds=0.01, full_seconds=3600, collect=collections)
        pacer.busy()
        pacer.busy()  # already ticking: still one tick at a time
        await until(lambda: len(collections.generations) >= 6)
        pacer.quiet()
        await until(lambda: pacer._due is None)  # the tick due found it quiet: none is scheduled after it
        stopped = len(collections.generations)
        assert set(collections.generations) == {1}
        pacer.busy()  # busy again: ticking again
        await until(lambda: len(collections.generations) > stopped)
        pacer.close()
        assert pacer._due is None
        pacer.busy()  # closed: nothing begins
        assert pacer._due is None

    asyncio.run(scenario())


def test_a_busy_instance_still_collects_fully_every_full_seconds() -> None:
    async def scenario() -> None:
        collections = Collections()
        pacer = CollectionPacer(tick_seconds=0.01, full_seconds=0.1, collect=collections)
        pacer.busy()
        await until(lambda: collections.generations.count(2) >= 2)
        pacer.close()
        first, second = [i for i, generation in enumerate(collections.generations) if generation == 2][:2]
        assert second - first > 1  # paced ones between them...
        assert collections.times[second] - collections.times[first] >= 0.1  # ...and a full one every full_seconds

    asyncio.run(scenario())
