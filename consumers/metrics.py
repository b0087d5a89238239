"""The trainer side's Prometheus metrics (``trajbus_consumer_*``), in the process's default registry.

A trainer exposes them with ``prometheus_client.start_http_server(port)``; the
names follow the scheme of the gateway (``trajbus_gateway_*``) and the stream
worker (``trajbus_worker_*``), so one dashboard reads all three.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, float("inf"))

GROUPS = Counter("trajbus_consumer_groups", "Ready groups fetched by trainers", ["channel"])
STEPS = Counter("trajbus_consumer_steps", "Steps of the fetched groups", ["channel"])
FETCHED_BYTES = Counter("trajbus_consumer_fetched_bytes",
                        "Bytes of groups-topic records this trainer received (its own and those it passed over)",
                        ["channel"])
TRIMMED = Counter("trajbus_consumer_groups_trimmed",
                  "Prefetched groups skipped because the queue bound had deleted them", ["channel"])
QUEUE_WAIT = Histogram("trajbus_consumer_group_wait_seconds", "Time from a group being ready to its fetch",
                       ["channel"], buckets=WAIT_BUCKETS)
