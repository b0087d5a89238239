"""The backlog signals admission decides on, read from Kafka by every gateway alike.

Twice a second, in one background thread, per channel in use:

- **ready groups**: the groups topic's end offsets minus the trainer consumer
  group's committed offsets (from the log start, where the queue bound deleted
  older groups) -- the same lag the worker's queue bound acts on;
- **groups in flight at other gateways**: each gateway writes a snapshot of its
  in-flight groups per channel to ``{prefix}.stats`` (the compacted topic the
  workers write theirs to; key ``gateway-...``, sample
  ``trajbus_gateway_in_flight_groups``; the key names the instance, ``--instance-id``, so a
  restarted instance replaces its own snapshot) and follows the topic for the others'.
  A snapshot older than ``SNAPSHOT_FRESH_SECONDS`` seconds is a gateway that stopped: not counted.

So several gateways on the same topics see the same backlog, with no
coordinator: each adds its own exact in-flight count to the others' latest.
One client of each kind is kept open, so a refresh is a few small requests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from confluent_kafka import Consumer, KafkaException, TopicPartition

from trajbus.infra.clients import acked_producer, reader
from trajbus.streams.wire.stats import (GATEWAY_KEY, decode_snapshot, encode_snapshot, in_flight_groups,
                                        in_flight_snapshot)
from trajbus.streams.wire.topics import groups_topic, stats_topic, trainer_group_id

log = logging.getLogger("trajbus.gateway")

REFRESH_SECONDS = 0.5
SNAPSHOT_FRESH_SECONDS = 5.0
"""Seconds a snapshot or a read of the lag stays valid: older is a gateway that stopped, or a lag unknown."""


class BacklogMonitor:
    """Ready groups per channel, and the in-flight groups of the other gateways; publishes this one's."""

    def __init__(self, bootstrap_servers: str, prefix: str, gateway_id: str,
                 in_flight: Callable[[], dict[str, set[str]]], on_refresh: Callable[[], None],
                 timeout: float = 5.0) -> None:
        self.prefix, self.gateway_id, self.timeout = prefix, gateway_id, timeout
        self._in_flight, self._on_refresh = in_flight, on_refresh
        self._channels: set[str] = set()
        self._ready: dict[str, tuple[int, float]] = {}
        """channel -> (ready groups, monotonic time of the read)."""
        self._others: dict[str, tuple[float, dict[str, set[str]]]] = {}
        """gateway id -> (updated_at, prompt groups in flight per channel), from their snapshots."""
        self.bootstrap_servers = bootstrap_servers
        self._committed: dict[str, Consumer] = {}
        """channel -> a consumer in the trainer's group that never subscribes: it only reads the commits."""
        self._consumer = reader(bootstrap_servers, {
            "group.id": f"{prefix}.gateway-backlog", "fetch.wait.max.ms": 100, "logger": log})
        self._consumer.assign([TopicPartition(stats_topic(prefix), 0, 0)])
        self._producer = acked_producer(bootstrap_servers, {"linger.ms": 0, "logger": log})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backlog-monitor", daemon=True)

    def start(self) -> None:
        """Refresh from now on; ``on_refresh`` may be called before this returns."""
        self._thread.start()

    def watch(self, channel: str) -> None:
        """Read this channel's backlog from now on (its first value comes with the next refresh)."""
        self._channels.add(channel)

    def channels(self) -> list[str]:
        return sorted(self._channels)

    def ready(self, channel: str) -> int | None:
        """Ready groups the trainer has not consumed; None until read (or while Kafka does not answer)."""
        self.watch(channel)
        ready, read_at = self._ready.get(channel, (None, 0.0))
        return ready if time.monotonic() - read_at <= SNAPSHOT_FRESH_SECONDS else None

    def elsewhere(self, channel: str) -> set[str]:
        """Prompt groups in flight at the other live gateways: a group whose rollouts several gateways
        serve is one group."""
        horizon = time.time() - SNAPSHOT_FRESH_SECONDS
        groups: set[str] = set()
        for at, by_channel in list(self._others.values()):
            if at >= horizon:
                groups |= by_channel.get(channel, set())
        return groups

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._refresh()
                while not self._stop.is_set() and time.monotonic() - started < REFRESH_SECONDS:
                    self._follow(max(0.0, REFRESH_SECONDS - (time.monotonic() - started)))
            except Exception as exc:  # noqa: BLE001 - a lag not read goes stale (unknown); never stop reading
                log.warning("backlog refresh failed: %s", exc)
                self._stop.wait(REFRESH_SECONDS)

    def _refresh(self) -> None:
        for channel in list(self._channels):
            try:
                self._ready[channel] = (self._read_ready(channel), time.monotonic())
            except (KafkaException, RuntimeError) as exc:  # unknown: admission waits rather than guesses
                log.warning("backlog of channel %s unavailable: %s", channel, exc)
        self._publish(self._in_flight())
        self._on_refresh()

    def _read_ready(self, channel: str) -> int:
        topic = groups_topic(channel, self.prefix)
        metadata = self._consumer.list_topics(topic, timeout=self.timeout).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return 0  # no groups topic yet: nothing is ready
        partitions = [TopicPartition(topic, p) for p in sorted(metadata.partitions)]
        if channel not in self._committed:  # not the AdminClient: its offset look-up of a group with no
            # coordinator yet can crash librdkafka (confluent-kafka-python #1982)
            self._committed[channel] = reader(self.bootstrap_servers, {
                "group.id": trainer_group_id(channel, self.prefix), "logger": log})
        committed = {tp.partition: tp.offset for tp in self._committed[channel].committed(partitions, self.timeout)}
        ready = 0
        for tp in partitions:
            low, high = self._consumer.get_watermark_offsets(tp, timeout=self.timeout)
            ready += max(0, high - max(low, committed.get(tp.partition, -1)))
        return ready

    def _publish(self, groups: dict[str, set[str]]) -> None:
        """This gateway's in-flight groups, counted (``samples``, as the workers' snapshots) and named
        (``groups``); every channel watched is named, so a count that drops to 0 is seen."""
        groups = {**{channel: set() for channel in self._channels}, **groups}
        self._producer.produce(stats_topic(self.prefix), key=self.gateway_id.encode(),
                               value=encode_snapshot(in_flight_snapshot(self.gateway_id, groups)))
        self._producer.poll(0)

    def _follow(self, timeout: float) -> None:
        for message in self._consumer.consume(100, timeout):
            if message.error() or message.key() is None:
                continue
            key = message.key().decode(errors="replace")
            if key == self.gateway_id or not key.startswith(GATEWAY_KEY):
                continue
            if message.value() is None:  # a gateway that stopped
                self._others.pop(key, None)
                continue
            try:
                snapshot = decode_snapshot(message.value())
                self._others[key] = (float(snapshot["updated_at"]), in_flight_groups(key, snapshot))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring gateway snapshot %s: %s", key, exc)

    def close(self) -> None:
        """Stop; the other gateways stop counting this one's groups at once (a tombstone)."""
        self._stop.set()
        self._thread.join(10)
        self._producer.produce(stats_topic(self.prefix), key=self.gateway_id.encode(), value=None)
        self._producer.flush(self.timeout)
        self._consumer.close()
        for consumer in self._committed.values():
            consumer.close()

