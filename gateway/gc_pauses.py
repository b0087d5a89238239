"""The cycle collector's pauses in this process, served at ``/metrics``: how long the event loop stood still.

A collection stops the gateway's one event loop, and every call in flight waits it out: with thousands of open
trajectories a full one walks every context's ids (``infra.collector`` sets the thresholds that make them rare,
not short). ``gc.callbacks`` times each collection from its start to its stop. The callback is installed once
per process, however many registries read it (a test builds many ``GatewayMetrics``; an instance of
``--instances N`` is its own process); a collection costs it two clock reads and a few additions.
"""

from __future__ import annotations

import bisect
import gc
import time
from typing import Any, Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Seconds: fine up to the gateway's target for a pause (20 ms, a bound, so a pause over it is counted exactly),
coarse above."""
GENERATIONS = (0, 1, 2)
HISTOGRAM = "trajbus_gateway_gc_pause_seconds"
LONGEST = "trajbus_gateway_gc_pause_max_seconds"
_HISTOGRAM_HELP = ("Pauses of Python's cycle collector in this gateway process (the event loop stands still "
                   "meanwhile), by generation")
_LONGEST_HELP = "The longest pause of Python's cycle collector in this gateway process since it began serving"


class GcPauses:
    """The ``gc.callbacks`` callback: every collection's pause since it was installed (or reset), by generation."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._started: float | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the pauses so far: the server calls it once it is built, before it takes calls, so the
        collections of its startup (one walks the whole heap before freezing it) count as no call's wait."""
        self.counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in GENERATIONS]
        """Per generation, collections per bucket (not cumulative; the last one is above every bound)."""
        self.sums = [0.0 for _ in GENERATIONS]
        self.longest = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        """Collections never overlap (CPython runs one at a time, under the GIL), so one start time is enough."""
        if phase == "start":
            self._started = self.clock()
            return
        if self._started is None:  # installed during a collection: its start was not seen
            return
        pause, self._started = self.clock() - self._started, None
        generation = min(int(info.get("generation", 2)), len(GENERATIONS) - 1)
        self.counts[generation][bisect.bisect_left(PAUSE_BUCKETS, pause)] += 1
        self.sums[generation] += pause
        if pause > self.longest:
            self.longest = pause


PAUSES = GcPauses()
"""This process's record (a forked instance inherits its parent's, and resets it when it begins serving)."""


class GcPauseCollector(Collector):
    """``PAUSES`` as a histogram by generation and a gauge of the longest pause, read at each scrape."""

    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(HISTOGRAM, _HISTOGRAM_HELP, labels=["generation"])
        yield GaugeMetricFamily(LONGEST, _LONGEST_HELP)

    def collect(self) -> Iterator[Metric]:
        histogram = HistogramMetricFamily(HISTOGRAM, _HISTOGRAM_HELP, labels=["generation"])
        for generation in GENERATIONS:
            counts, total = list(self.pauses.counts[generation]), self.pauses.sums[generation]
            cumulative, buckets = 0, []
            for bound, count in zip((*PAUSE_BUCKETS, float("inf")), counts):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            histogram.add_metric([str(generation)], buckets, sum_value=total)
        yield histogram
        yield GaugeMetricFamily(LONGEST, _LONGEST_HELP, value=self.pauses.longest)


def register(registry: CollectorRegistry) -> None:
    """Serve this process's collector pauses from ``registry``; the callback is installed at the first call."""
    if PAUSES not in gc.callbacks:
        gc.callbacks.append(PAUSES)
    registry.register(GcPauseCollector(PAUSES))
