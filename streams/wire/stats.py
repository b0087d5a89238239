"""The statistics record on ``{prefix}.stats`` (compacted), and how snapshots add up.

Key: the writer's id. Value: UTF-8 JSON ``{"worker_id", "updated_at", "samples": [[name, labels, value],
...]}``, a stream worker's Prometheus samples (``streams.worker.stats``), or a gateway's in-flight groups
(key ``gateway-...``, ``gateway.admission.backlog``). Counters add up over every snapshot, gauges over
live writers only: a writer is live while its snapshots are recent (``LIVE_WITHIN``); a worker that stops
says so in its last snapshot (``"stopped": true``), and a gateway that stops writes a tombstone, so
neither counts as live for the ``LIVE_WITHIN`` seconds after it is gone.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Any

LIVE_WITHIN = 30.0
"""Seconds a snapshot speaks for a running worker: many of its ``--stats-interval``s, so a busy worker
whose snapshot is late still counts."""


def snapshot_of(writer_id: str, samples: list[list[Any]], stopped: bool = False) -> dict[str, Any]:
    """A snapshot of ``samples`` (``[name, labels, value]``), stamped with its writer and the time;
    ``stopped``: the writer's last, which ends its liveness at once."""
    snapshot = {"worker_id": writer_id, "updated_at": time.time(), "samples": samples}
    return {**snapshot, "stopped": True} if stopped else snapshot


GATEWAY_KEY = "gateway-"
"""A gateway's snapshots are keyed ``gateway-<instance id>``; a worker's by its worker id."""
IN_FLIGHT_SAMPLE = "trajbus_gateway_in_flight_groups"
"""A gateway's sample: the groups it has in flight on a channel (label ``channel``)."""


def gateway_key(instance: str) -> str:
    return f"{GATEWAY_KEY}{instance}"


def in_flight_snapshot(gateway_id: str, groups: dict[str, set[str]]) -> dict[str, Any]:
    """A gateway's snapshot: its in-flight groups counted (``samples``, as a worker's) and named (``groups``)."""
    samples = [[IN_FLIGHT_SAMPLE, {"channel": c}, len(g)] for c, g in sorted(groups.items())]
    return {**snapshot_of(gateway_id, samples), "groups": {c: sorted(g) for c, g in groups.items()}}


def in_flight_groups(gateway_id: str, snapshot: dict[str, Any]) -> dict[str, set[str]]:
    """A gateway snapshot's in-flight groups per channel; a gateway that sends only counts (an older version)
    gets that many groups of its own."""
    if "groups" in snapshot:
        return {channel: {str(uid) for uid in uids} for channel, uids in snapshot["groups"].items()}
    return {labels["channel"]: {f"{gateway_id}#{i}" for i in range(int(value))}
            for name, labels, value in snapshot["samples"] if name == IN_FLIGHT_SAMPLE}


def encode_snapshot(snapshot: dict[str, Any]) -> bytes:
    return json.dumps(snapshot).encode()


def decode_snapshot(value: bytes) -> dict[str, Any]:
    return json.loads(value)


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
