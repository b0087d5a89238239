"""The stream processor's statistics: its Prometheus metrics.

The Prometheus registry is the one source of truth. Every few seconds each
worker also writes a snapshot of it to ``{prefix}.stats`` (compacted, keyed by
worker id; the record and how snapshots add up: ``streams.wire.stats``), so
``trajbus stats`` can add up all workers with nothing but Kafka.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trajbus.streams.wire.stats import snapshot_of

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, float("inf"))


class WorkerMetrics:
    """Counters and gauges per channel, named ``trajbus_worker_*``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
        self.events = Counter("trajbus_worker_events", "Step events read, by kind", ["channel", "kind"], registry=r)
        self.duplicates = Counter("trajbus_worker_duplicate_events", "Redelivered events counted once",
                                  ["channel"], registry=r)
        self.late = Counter("trajbus_worker_late_events", "Events for groups already emitted or dropped",
                            ["channel"], registry=r)
        self.dlq = Counter("trajbus_worker_dlq_records", "Records written to the DLQ, by reason",
                           ["channel", "reason"], registry=r)
        self.trajectories = Counter("trajbus_worker_trajectories_completed", "Trajectories completed",
                                    ["channel"], registry=r)
        self.groups = Counter("trajbus_worker_groups", "Groups by outcome: ready, partial, emitted",
                              ["channel", "outcome"], registry=r)
        self.dropped = Counter("trajbus_worker_groups_dropped", "Groups dropped, by reason",
                               ["channel", "reason"], registry=r)
        self.source_position = Gauge("trajbus_worker_source_position",
                                     "Next steps-topic offset to apply, per partition this worker applied",
                                     ["channel", "partition"], registry=r)
        self.pending_groups = Gauge("trajbus_worker_pending_groups", "Groups still assembling", ["channel"],
                                    registry=r)
        self.pending_trajectories = Gauge("trajbus_worker_pending_trajectories",
                                          "Trajectories of groups still assembling", ["channel"], registry=r)
        self.queue_depth = Gauge("trajbus_groups_queue_depth", "Ready groups the trainer has not consumed",
                                 ["channel"], registry=r)
        self.policy_version = Gauge("trajbus_worker_policy_version", "Newest version on the policy topic",
                                    ["channel"], registry=r)
        self.step_cache_bytes = Gauge("trajbus_worker_step_cache_bytes",
                                      "Bytes of pending groups' steps held in memory (--step-cache-bytes)",
                                      registry=r)
        self.steps_read_back = Counter("trajbus_worker_steps_read_back",
                                       "Steps-topic records read back to emit groups whose bodies were not held",
                                       registry=r)
        self.partitions_held = Gauge("trajbus_worker_partitions_held",
                                     "1 for each steps partition this worker holds (none while rebalancing)",
                                     ["channel", "partition"], registry=r)
        self.group_rejoins = Counter("trajbus_worker_group_rejoins",
                                     "Consumer-group rejoins for a topic the group's assignment left out",
                                     registry=r)
        self.staleness = Histogram("trajbus_worker_group_staleness",
                                   "Policy versions between a group's oldest step and the current policy",
                                   ["channel"], buckets=STALENESS_BUCKETS, registry=r)

    def hold(self, held: dict[str, set[int]]) -> None:
        """The steps partitions held now, by channel (after an assignment; ``{}`` once they are revoked)."""
        self.partitions_held.clear()
        for channel, partitions in held.items():
            for partition in partitions:
                self.partitions_held.labels(channel, str(partition)).set(1)

    def snapshot(self, stopped: bool = False) -> dict[str, Any]:
        """Every sample of the registry as ``[name, labels, value]``, stamped with worker and time;
        ``stopped``: the worker's last, which ends its liveness at once."""
        samples = [[s.name, s.labels, s.value] for metric in self.registry.collect() for s in metric.samples
                   if not s.name.endswith("_created")]
        return snapshot_of(self.worker_id, samples, stopped)
