"""The gateway's collector-pause metrics: each collection timed from its start to its stop, once per process."""

from __future__ import annotations

import gc

from trajbus.gateway import gc_pauses
from trajbus.gateway.gc_pauses import HISTOGRAM, LONGEST, PAUSES, GcPauses
from trajbus.gateway.metrics import GatewayMetrics


def test_a_collection_is_served_as_a_pause_of_its_generation_and_the_longest_so_far():
    registry = GatewayMetrics("test", "http://test").registry
    count = f"{HISTOGRAM}_count"
    before = registry.get_sample_value(count, {"generation": "2"})
    gc.collect()  # a full collection: generation 2
    assert registry.get_sample_value(count, {"generation": "2"}) == before + 1
    assert registry.get_sample_value(f"{HISTOGRAM}_sum", {"generation": "2"}) > 0
    assert registry.get_sample_value(LONGEST) > 0


def test_the_callback_is_installed_once_however_many_registries_serve_it():
    GatewayMetrics("a", "http://a"), GatewayMetrics("b", "http://b")
    assert gc.callbacks.count(PAUSES) == 1


def test_a_pause_falls_in_the_bucket_of_its_bound_and_raises_the_longest():
    clock = iter([1.0, 1.03, 2.0, 2.0004])
    pauses = GcPauses(clock=lambda: next(clock))
    pauses("stop", {"generation": 0})  # installed mid-collection: no start seen, nothing counted
    pauses("start", {"generation": 2})
    pauses("stop", {"generation": 2})
    pauses("start", {"generation": 0})
    pauses("stop", {"generation": 0})
    over_target = gc_pauses.PAUSE_BUCKETS.index(0.05)  # 30 ms: above 0.02, within 0.05
    assert pauses.counts[2][over_target] == 1 and sum(pauses.counts[2]) == 1
    assert pauses.counts[0][gc_pauses.PAUSE_BUCKETS.index(0.0005)] == 1 and sum(pauses.counts[0]) == 1
    assert abs(pauses.longest - 0.03) < 1e-9 and abs(pauses.sums[2] - 0.03) < 1e-9
    pauses.reset()  # the server, once built: its startup's collections are no call's wait
    assert pauses.longest == 0 and not any(map(any, pauses.counts)) and not any(pauses.sums)
