"""Every Kafka client of trajbus, by role: one factory per role, each with a cluster's defaults.

A client is built for what it does, never from a settings dict of its own:

- ``acked_producer``: a record counts once the broker acknowledged it (steps, groups, DLQ,
  policy versions, stats);
- ``transactional_producer``: records and offsets that commit together;
- ``trainer_consumer``: a consumer group whose commit is the trainer's position;
- ``reader``: assigned partitions read at chosen offsets, never committing (replay, tail,
  chunk look-ups, offset and watermark probes);
- ``admin``: topics, configs, groups, and the reachability probes.

The defaults are the ones a replicated cluster needs (a broker lost, a leader elected,
a rolling restart): they live in ``COMMON`` and ``ROLE_DEFAULTS``. A call site adds what
makes it itself (linger, compression, partitioner, fetch sizes, a group id, its logger) in
``settings``, which win. The connection (bootstrap list, security) is
``kafka_config.KafkaConnection``; ``kafka_config.client_config`` puts it first and routes
librdkafka's log lines through Python logging.
"""

from __future__ import annotations

import time
import uuid
from types import MappingProxyType
from typing import Any, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ClusterMetadata

from trajbus.infra.kafka_config import KafkaConnection, authentication_failure, client_config

__all__ = ["COMMON", "ROLE_DEFAULTS", "RefusedCredentials", "acked_producer", "admin", "cluster_metadata", "reader", "role_config", "trainer_consumer",
           "transactional_producer"]

DELIVERY_TIMEOUT_MS = 120_000
"""How long a produced record may wait for its acknowledgement, retries included. A leader
election after a broker's death takes seconds to a few tens of seconds (the controller first
waits out the dead broker's session); 120 s covers it with room, and still fails a record
whose cluster stays away, rather than librdkafka's 300 s."""

REQUEST_TIMEOUT_MS = 30_000
"""One request's wait for its answer (librdkafka's own default, stated): a request to a leader
that died fails in this time and is retried against the new one."""

METADATA_REFRESH_MS = 30_000
"""Periodic metadata refresh, down from librdkafka's 5 minutes: a client learns of a moved leader
or a new partition it has no error to tell it of. After an error (no leader, not the leader,
unknown partition) librdkafka refreshes at once and then fast until a leader is known; that is
its default and stays on."""

COMMON: Mapping[str, Any] = MappingProxyType({"topic.metadata.refresh.interval.ms": METADATA_REFRESH_MS})
"""Every role's defaults."""

_ACKED = {
    "enable.idempotence": True,  # a retry through an election is written once (producer id + sequence)
    "acks": "all",  # acknowledged means on every in-sync replica: a leader's death loses nothing acknowledged
    "delivery.timeout.ms": DELIVERY_TIMEOUT_MS,
    "request.timeout.ms": REQUEST_TIMEOUT_MS,
}

ROLE_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "acked_producer": MappingProxyType(_ACKED),
    # A transaction must outlive its records' delivery timeout (librdkafka refuses less).
    "transactional_producer": MappingProxyType({**_ACKED, "transaction.timeout.ms": DELIVERY_TIMEOUT_MS}),
    "trainer_consumer": MappingProxyType({
        "enable.auto.commit": False,  # the trainer commits after it used a batch: at-least-once
        "auto.offset.reset": "earliest",  # a new group starts at the oldest retained record
        "isolation.level": "read_committed",  # what the worker emitted exactly once, nothing aborted
    }),
    "reader": MappingProxyType({
        "enable.auto.commit": False,  # a reader never moves a group's position
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",
    }),
    "admin": MappingProxyType({}),
})
"""Each role's defaults, on top of ``COMMON``."""


def role_config(role: str, servers: str | KafkaConnection, settings: Mapping[str, Any] | None = None
                ) -> dict[str, Any]:
    """The confluent-kafka configuration of ``role``: connection, ``COMMON``, the role's defaults,
    then ``settings`` (the call site's own, which win)."""
    return client_config(servers, {**COMMON, **ROLE_DEFAULTS[role], **(settings or {})})


def acked_producer(servers: str | KafkaConnection, settings: Mapping[str, Any] | None = None) -> Producer:
    """A producer whose records count once acknowledged by every in-sync replica, written once."""
    return Producer(role_config("acked_producer", servers, settings))


def transactional_producer(servers: str | KafkaConnection, transactional_id: str,
                           settings: Mapping[str, Any] | None = None) -> Producer:
    """An acknowledged producer whose writes (and consumer offsets) commit together; the caller runs
    ``init_transactions()`` first. ``transactional_id`` fences a predecessor with the same id."""
    return Producer(role_config("transactional_producer", servers,
                                {"transactional.id": transactional_id, **(settings or {})}))


def trainer_consumer(servers: str | KafkaConnection, group_id: str,
                     settings: Mapping[str, Any] | None = None) -> Consumer:
    """A member of ``group_id``, whose committed offsets are the trainer's position."""
    return Consumer(role_config("trainer_consumer", servers, {"group.id": group_id, **(settings or {})}))


def reader(servers: str | KafkaConnection, settings: Mapping[str, Any] | None = None) -> Consumer:
    """A consumer for ``assign()`` and offset look-ups that never commits. librdkafka wants a group id
    even so: a unique one unless ``settings`` names one (a probe of a group's commits names it)."""
    settings = dict(settings or {})
    settings.setdefault("group.id", f"trajbus.reader.{uuid.uuid4().hex[:8]}")
    return Consumer(role_config("reader", servers, settings))


def admin(servers: str | KafkaConnection, settings: Mapping[str, Any] | None = None) -> AdminClient:
    """An admin client: topics, configs, groups; its ``list_topics`` is the reachability probe."""
    return AdminClient(role_config("admin", servers, settings))


class RefusedCredentials(KafkaException):
    """The broker refused this process's credentials or TLS handshake: no retry mends it."""


def cluster_metadata(client: AdminClient, timeout: float, topic: str | None = None) -> ClusterMetadata:
    """``client.list_topics`` in short slices, its error callback served between them, so refused
    credentials end the wait at once (``RefusedCredentials``) rather than after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.list_topics(topic, timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except KafkaException as exc:
            client.poll(0)
            refused = authentication_failure()
            if refused:
                raise RefusedCredentials(KafkaError(KafkaError._AUTHENTICATION, refused)) from exc
            if time.monotonic() >= deadline:
                raise
