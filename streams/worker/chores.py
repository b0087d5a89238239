"""The worker process's chores beside assembly: the policy versions it follows, its statistics on Kafka,
its Prometheus endpoint.

The process starts them once its topics exist and closes them as it stops (``streams.worker.process``);
the assembler is only handed what it reads (``PolicyVersions``) and what it publishes to (``StatsPublisher``).
Nothing here connects before ``start`` or a first snapshot, so unit tests build them and never start them.
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from confluent_kafka import Producer
from prometheus_client import CollectorRegistry, start_http_server

from trajbus.infra.clients import acked_producer
from trajbus.streams.client.policy import PolicyWatcher
from trajbus.streams.wire.stats import encode_snapshot
from trajbus.streams.wire.topics import stats_topic
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.stats import WorkerMetrics

log = logging.getLogger("trajbus.worker")


class PolicyVersions:
    """The trainer's policy version per channel, followed on the policy topic once started (None before)."""

    def __init__(self, bootstrap_servers: str, prefix: str) -> None:
        self.bootstrap_servers, self.prefix = bootstrap_servers, prefix
        self.watcher: PolicyWatcher | None = None

    def start(self) -> None:
        self.watcher = PolicyWatcher(self.bootstrap_servers, self.prefix)

    def current(self, channel: str) -> int | None:
        return self.watcher.current(channel) if self.watcher else None

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()


class StatsPublisher:
    """This worker's snapshots on the stats topic, one per ``interval`` at most; its producer opens with the
    first, and ``close`` sends the last, marked stopped (``trajbus stats`` counts the worker as live no longer)."""

    def __init__(self, bootstrap_servers: str, prefix: str, metrics: WorkerMetrics, interval: float) -> None:
        self.bootstrap_servers, self.prefix, self.metrics, self.interval = bootstrap_servers, prefix, metrics, interval
        self.producer: Producer | None = None
        self._last = 0.0

    def publish_due(self, now: float) -> None:
        """A snapshot, unless the last one went out less than ``interval`` seconds before ``now``."""
        if now - self._last >= self.interval:
            self._last = now
            self.publish()

    def publish(self, stopped: bool = False) -> None:
        if self.producer is None:
            self.producer = acked_producer(self.bootstrap_servers, {"logger": log, "linger.ms": 50})
        self.producer.produce(stats_topic(self.prefix), key=self.metrics.worker_id.encode(),
                              value=encode_snapshot(self.metrics.snapshot(stopped)))
        self.producer.poll(0)

    def close(self) -> None:
        """The last snapshot, marked stopped, where any went out; then the producer closes."""
        if self.producer is None:
            return
        self.publish(stopped=True)
        self.producer.flush(10)
        self.producer.close()
        self.producer = None


class MetricsServer:
    """The Prometheus endpoint of ``registry`` on ``host:port`` once started; none where ``port`` is None."""

    def __init__(self, host: str, port: int | None, registry: CollectorRegistry) -> None:
        self.host, self.port, self.registry = host, port, registry
        self.server: WSGIServer | None = None

    def start(self) -> None:
        if self.port is None:
            return
        self.server, _thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", self.host, self.server.server_port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class WorkerChores:
    """The three chores, started and closed in one order: the policy watcher, then the metrics server;
    at the end the last statistics out first, then the watcher, then the server."""

    def __init__(self, settings: WorkerSettings, bootstrap_servers: str, metrics: WorkerMetrics) -> None:
        prefix = settings.topics.prefix
        self.policy = PolicyVersions(bootstrap_servers, prefix)
        self.stats = StatsPublisher(bootstrap_servers, prefix, metrics, settings.stats_interval)
        self.metrics_server = MetricsServer(settings.metrics_host, settings.metrics_port, metrics.registry)

    def start(self) -> None:
        self.policy.start()
        self.metrics_server.start()

    def close(self) -> None:
        self.stats.close()
        self.policy.close()
        self.metrics_server.close()
