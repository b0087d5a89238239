"""The stream processor's statistics: Prometheus metrics, and snapshots on Kafka.

The Prometheus registry is the one source of truth. Every few seconds each
worker also writes a snapshot of it to ``{prefix}.stats`` (compacted, keyed by
worker id), so ``trajbus stats`` can add up all workers with nothing but Kafka.

A worker is live while its snapshots are recent (``LIVE_WITHIN``); one that stops says so in its last
snapshot (``"stopped": true``), and a gateway that stops writes a tombstone, so neither counts as live
for the ``LIVE_WITHIN`` seconds after it is gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import defaultdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, float("inf"))
LIVE_WITHIN = 30.0
"""Seconds a snapshot speaks for a running worker: many of its ``--stats-interval``s, so a busy worker
whose snapshot is late still counts."""


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
        snapshot = {"worker_id": self.worker_id, "updated_at": time.time(), "samples": samples}
        return {**snapshot, "stopped": True} if stopped else snapshot


def is_live(snapshot: dict[str, Any], now: float, live_within: float = LIVE_WITHIN) -> bool:
    """Whether the snapshot's writer runs: it wrote within ``live_within`` seconds, and not as it stopped."""
    return not snapshot.get("stopped", False) and now - snapshot["updated_at"] <= live_within


def summarize(snapshots: list[dict[str, Any]], live_within: float = LIVE_WITHIN) -> dict[str, dict[str, Any]]:
    """Per channel: counters summed over every worker, gauges summed over live workers only."""
    now = time.time()
    channels: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    for snapshot in snapshots:
        live = is_live(snapshot, now, live_within)
        for name, labels, value in snapshot["samples"]:
            channel = labels.get("channel")
            if channel is None:
                continue
            row = channels[channel]
            short = name
            for prefix in ("trajbus_worker_", "trajbus_groups_", "trajbus_gateway_"):
                short = short.removeprefix(prefix)
            if name.endswith("_total"):
                detail = labels.get("kind") or labels.get("outcome") or labels.get("reason")
                key = short.removesuffix("_total") + (f"[{detail}]" if detail else "")
                row[key] += value
            elif name.endswith("_bucket"):
                row.setdefault("staleness_le", defaultdict(float))[labels["le"]] += value
            elif name.endswith(("_count", "_sum")):
                row[short] += value
            elif live:
                if short in ("queue_depth", "policy_version"):
                    row[short] = max(row.get(short, value), value)
                else:
                    row[short] += value
    return {c: dict(v) for c, v in channels.items()}


def held_partitions(snapshots: list[dict[str, Any]], live_within: float = LIVE_WITHIN
                    ) -> dict[str, dict[str, list[int]]]:
    """Worker id -> channel -> the steps partitions it holds, for each live worker (one holding none: ``{}``)."""
    now = time.time()
    held: dict[str, dict[str, list[int]]] = {}
    for snapshot in snapshots:
        if not is_live(snapshot, now, live_within):
            continue
        mine = held.setdefault(snapshot["worker_id"], {})
        for name, labels, value in snapshot["samples"]:
            if name == "trajbus_worker_partitions_held" and value:
                mine.setdefault(labels["channel"], []).append(int(labels["partition"]))
        for partitions in mine.values():
            partitions.sort()
    return held


def encode_snapshot(snapshot: dict[str, Any]) -> bytes:
    return json.dumps(snapshot).encode()


def decode_snapshot(value: bytes) -> dict[str, Any]:
    return json.loads(value)


def read_snapshots(bootstrap_servers: str, prefix: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The newest snapshot of every worker that ever wrote one (and no tombstone after it), read from the
    compacted stats topic."""
    from confluent_kafka import TopicPartition

    from trajbus.infra.clients import reader
    from trajbus.infra.topics import watermarks
    from trajbus.streams.wire.topics import stats_topic

    topic = stats_topic(prefix)
    consumer = reader(bootstrap_servers, {"group.id": f"{prefix}.stats-reader"})
    latest: dict[bytes, dict[str, Any]] = {}
    try:
        metadata = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return []
        assignment = []
        ends = {}
        for p in metadata.partitions:
            low, high = watermarks(consumer, TopicPartition(topic, p), timeout)
            if high > low:
                assignment.append(TopicPartition(topic, p, low))
                ends[p] = high
        consumer.assign(assignment)
        deadline = time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            if message.value() is None:  # a tombstone: its writer stopped (a gateway)
                latest.pop(message.key(), None)
            else:
                latest[message.key()] = decode_snapshot(message.value())
            if message.offset() + 1 >= ends.get(message.partition(), 0):
                ends.pop(message.partition(), None)
    finally:
        consumer.close()
    return list(latest.values())


def applied_positions(snapshots: list[dict[str, Any]], pids: set[int]) -> dict[tuple[str, int], float]:
    """(channel, source partition) -> next offset to apply, the furthest any worker of ``pids`` published:
    what those workers have applied, to compare with the steps topics' ends."""
    positions: dict[tuple[str, int], float] = {}
    for snapshot in snapshots:
        if any(f"-{pid}-" in snapshot["worker_id"] for pid in pids):
            for name, labels, value in snapshot["samples"]:
                if name == "trajbus_worker_source_position":
                    key = (labels["channel"], int(labels["partition"]))
                    positions[key] = max(value, positions.get(key, 0))
    return positions
