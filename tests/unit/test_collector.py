"""The serving collector settings (``infra.collector``), in a fresh interpreter: the test process keeps its own."""

import subprocess
import sys

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
