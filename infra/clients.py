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
a rolling restart): they live in ``client_roles.COMMON`` and ``client_roles.ROLE_DEFAULTS``.
A call site adds what makes it itself (linger, compression, partitioner, fetch sizes, a group
id, its logger) in ``settings``, which win. The connection (bootstrap list, security) is
``kafka_config.KafkaConnection``; ``client_config`` puts it first, routes librdkafka's log lines
through Python logging (``client_roles``) and each client's errors through ``ClientErrors``: refused
credentials are remembered (``authentication_failure``), connection failures told to the cluster's
``infra.outage.ClusterOutage``.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ClusterMetadata

from trajbus.infra.client_roles import CLIENT_LOGGER, connection_config, reader_settings, role_settings
from trajbus.infra.kafka_config import KafkaConnection, connection_properties, error_words
from trajbus.infra.outage import cluster_outage

__all__ = ["ClientErrors", "RefusedCredentials", "acked_producer", "admin", "authentication_failure", "client_config",
           "cluster_metadata", "explain", "reader", "role_config", "trainer_consumer", "transactional_producer"]

_authentication_failure: tuple[str, str] | None = None
"""(what failed, librdkafka's words): the last refused login or TLS handshake seen by any client."""
SECURITY_CHECKS = {"authentication": "sasl.username and sasl.password",
                   "TLS handshake": "ssl.ca.location (the CA that signed the broker's certificate)"}


def client_config(bootstrap_servers: str | KafkaConnection, settings: Mapping[str, Any] | None = None
                  ) -> dict[str, Any]:
    """A confluent-kafka producer, consumer or admin configuration: the connection, then the client's
    own ``settings`` (which win: they say what the client is for). Its ``logger`` (default
    ``trajbus.kafka``) is wrapped in ``ClientLog`` and its ``error_cb`` is a ``ClientErrors`` of its
    cluster: every client's library lines and errors pass here (a probe passes an ``error_cb`` of its own
    to stay out of the outage it probes)."""
    connection = KafkaConnection.of(bootstrap_servers)
    return connection_config(connection, {"error_cb": ClientErrors(connection.bootstrap_servers), **(settings or {})})


def role_config(role: str, servers: str | KafkaConnection, settings: Mapping[str, Any] | None = None
                ) -> dict[str, Any]:
    """The confluent-kafka configuration of ``role``: connection, ``COMMON``, the role's defaults,
    then ``settings`` (the call site's own, which win)."""
    return client_config(servers, role_settings(role, settings))


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
    """A consumer for ``assign()`` and offset look-ups that never commits (a unique group id unless
    ``settings`` names one: ``client_roles.reader_settings``)."""
    return Consumer(client_config(servers, reader_settings(settings)))


def admin(servers: str | KafkaConnection, settings: Mapping[str, Any] | None = None) -> AdminClient:
    """An admin client: topics, configs, groups; its ``list_topics`` is the reachability probe."""
    return AdminClient(role_config("admin", servers, settings))


class ClientErrors:
    """librdkafka's error callback of one client: refused credentials or a failed TLS handshake are
    remembered, so a command can name them; connection failures go to the cluster's ``ClusterOutage``,
    which tells an outage once (each error itself is a DEBUG record)."""

    def __init__(self, bootstrap_servers: str) -> None:
        self.outage = cluster_outage(bootstrap_servers)

    def __call__(self, error: Any) -> None:
        global _authentication_failure

        code = error.code()
        kind = {KafkaError._AUTHENTICATION: "authentication", KafkaError._SSL: "TLS handshake"}.get(code)
        if kind is not None and _authentication_failure != (kind, error.str()):
            _authentication_failure = (kind, error.str())
            logging.getLogger(__name__).debug("kafka %s failed: %s", kind, error.str())  # callers say it
        if code == KafkaError._ALL_BROKERS_DOWN:
            self.outage.all_brokers_down()
        elif code in (KafkaError._TRANSPORT, KafkaError._RESOLVE) or kind is not None:
            self.outage.failure(_attempt(error.str()))
        logging.getLogger(CLIENT_LOGGER).debug("kafka client error: %s", error.str())


def _attempt(text: str) -> str:
    """A failed attempt's words without the broker handle's prefix and timings, for the outage's line:
    ``127.0.0.1:9/bootstrap: Connect to ipv4#127.0.0.1:9 failed: Connection refused (after 0ms in state
    CONNECT)`` is ``Connect to ipv4#127.0.0.1:9 failed: Connection refused``."""
    text = re.sub(r"^\S+/(\d+|bootstrap): ", "", text)
    return re.sub(r" \(after \d+ms in state \w+\)", "", text).strip()


def authentication_failure(bootstrap_servers: str | None = None, timeout: float = 3.0) -> str | None:
    """Why the broker refused this process's credentials or its TLS handshake failed, if so, in one
    line naming what to check. With ``bootstrap_servers``, and SASL or TLS configured, a failure not
    seen yet is looked for with a short-lived client (librdkafka reports it only to a polled client,
    while the call that failed just says "transport failure")."""
    if _authentication_failure is None and bootstrap_servers and \
            connection_properties().get("security.protocol", "PLAINTEXT").upper() != "PLAINTEXT":
        probe = reader(bootstrap_servers, {"logger": logging.getLogger(__name__ + ".probe"), "log_level": 0})
        deadline = time.monotonic() + timeout
        while _authentication_failure is None and time.monotonic() < deadline:
            probe.poll(0.1)
        probe.close()
    if _authentication_failure is None:
        return None
    kind, text = _authentication_failure
    return f"Kafka {kind} failed ({text}); check {SECURITY_CHECKS[kind]}"


def explain(exc: BaseException, bootstrap_servers: str | None = None) -> str:
    """A Kafka failure in one line, naming refused credentials or TLS first (the cause, not its symptom)."""
    return authentication_failure(bootstrap_servers) or f"Kafka: {error_words(exc)}"


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
