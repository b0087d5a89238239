"""``/dashboard``: a live page of what flows (throughput, queue depth, staleness, drops, admission, weight
updates, reward).

The page (``static/dashboard.html``) polls ``/dashboard/data`` every second;
throughput is measured here, over the last ten seconds, so any viewer sees it at once.
The numbers come from the gateway's own metrics and from the stream workers'
snapshots on ``{prefix}.stats`` (read at most once a second, off the event loop).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path
from typing import Any

from trajbus.gateway.admission.pacing import Pacing
from trajbus.gateway.broker.kafka_link import KafkaLink
from trajbus.gateway.engine.updates import UpdateGate
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.streams.client.snapshots import read_snapshots
from trajbus.streams.wire.stats import summarize

PAGE = Path(__file__).parent / "static" / "dashboard.html"


class DashboardData:
    """What the page shows, from the parts it is handed; the workers' snapshots read at most every ``max_age``."""

    def __init__(self, kafka: KafkaLink, prefix: str, metrics: GatewayMetrics, updates: UpdateGate, pacing: Pacing,
                 max_age: float = 1.0) -> None:
        self.kafka, self.prefix, self.metrics, self.updates, self.pacing = kafka, prefix, metrics, updates, pacing
        self.max_age = max_age
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()
        self._samples: deque[tuple[float, float]] = deque(maxlen=120)
        """(monotonic time, steps published), for the rate over the last seconds."""

    def _rate(self, steps: float) -> float:
        now = time.monotonic()
        if not self._samples or now - self._samples[-1][0] >= 0.5:
            self._samples.append((now, steps))
        window = [(t, n) for t, n in self._samples if now - t <= 10.0]
        if len(window) < 2 or window[-1][0] - window[0][0] < 1.0:
            return 0.0
        return (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])

    def _worker_summary(self) -> dict[str, dict[str, Any]]:
        servers = self.kafka.bootstrap_servers
        return summarize(read_snapshots(servers, self.prefix, timeout=5.0)) if servers else {}

    def _updates(self) -> dict[str, Any]:
        """Weight updates: paused now, updates so far and their mean pause, generations cut/continued/expired."""
        metrics = self.metrics
        paused = {s.name.rsplit("_", 1)[-1]: s.value for m in metrics.pause_seconds.collect() for s in m.samples
                  if s.name.endswith(("_sum", "_count"))}
        events = {s.labels["event"]: int(s.value) for m in metrics.generations.collect() for s in m.samples
                  if s.name.endswith("_total")}
        count = int(paused.get("count", 0))
        return {**self.updates.state(), "updates": count,
                "mean_pause_s": paused.get("sum", 0.0) / count if count else None,
                **{event: events.get(event, 0) for event in ("cut", "continued", "expired")}}

    async def get(self) -> dict[str, Any]:
        async with self._lock:
            if self._cached is None or time.monotonic() - self._cached[0] > self.max_age:
                workers = await asyncio.to_thread(self._worker_summary)
                self._cached = (time.monotonic(), workers)
            workers = self._cached[1]
        metrics = self.metrics
        steps = sum(s.value for m in metrics.steps.collect() for s in m.samples if s.name.endswith("_total"))
        rewards: dict[str, dict[str, float]] = {}
        for metric in metrics.reward.collect():
            for sample in metric.samples:
                entry = rewards.setdefault(sample.labels["policy_version"], {"sum": 0.0, "count": 0})
                if sample.name.endswith("_sum"):
                    entry["sum"] = sample.value
                elif sample.name.endswith("_count"):
                    entry["count"] = int(sample.value)
        staleness_sum = sum(row.get("group_staleness_sum", 0.0) for row in workers.values())
        staleness_count = sum(row.get("group_staleness_count", 0.0) for row in workers.values())
        dropped: dict[str, float] = {}
        for row in workers.values():
            for key, value in row.items():
                if key.startswith("groups_dropped["):
                    reason = key[len("groups_dropped["):-1]
                    dropped[reason] = dropped.get(reason, 0) + value
        admissions = [[s.labels["channel"], s.labels["outcome"], s.labels["reason"], int(s.value)]
                      for m in metrics.admissions.collect() for s in m.samples if s.name.endswith("_total")]
        admissions += [[s.labels["channel"], "waiting now", s.labels["reason"], int(s.value)]
                       for m in metrics.waiting.collect() for s in m.samples if s.value]
        return {
            "admission": self.pacing.state(), "admissions": admissions, "updates": self._updates(),
            "time": time.time(), "prefix": self.prefix, "steps_published": int(steps),
            "steps_per_s": round(self._rate(steps), 2),
            "groups_emitted": int(sum(row.get("groups[emitted]", 0) for row in workers.values())),
            "queue_depth": int(sum(row.get("queue_depth", 0) for row in workers.values())),
            "mean_staleness": staleness_sum / staleness_count if staleness_count else None,
            "dropped": {k: int(v) for k, v in sorted(dropped.items())},
            "rewards": {v: {"count": r["count"], "mean": r["sum"] / r["count"]}
                        for v, r in sorted(rewards.items(), key=lambda kv: int(kv[0])) if r["count"]},
            "channels": sorted(workers),
        }
