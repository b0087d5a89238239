"""What every Kafka client of trajbus is configured with, before it reports to anyone.

Each role's defaults are the ones a replicated cluster needs (a broker lost, a leader
elected, a rolling restart): ``COMMON`` and ``ROLE_DEFAULTS``. ``connection_config``
puts the connection (``kafka_config.KafkaConnection``) first, a client's own settings
after it, and routes librdkafka's lines through Python logging (``ClientLog``).

No error callback is added here: ``clients.client_config`` adds the one that tells the
cluster's outage (``infra.outage``), and the outage's own probes bring theirs (their
failed attempts are the outage they look at). So this module sits below both.
"""

from __future__ import annotations

import logging
import re
import uuid
from types import MappingProxyType
from typing import Any, Mapping

from trajbus.infra.kafka_config import KafkaConnection

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

CLIENT_LOGGER = "trajbus.kafka"
"""Where librdkafka's lines go when a client names no logger of its own."""


class ClientLog:
    """librdkafka's lines as Python log records of a trajbus logger, so they reach the terminal only
    through the process's log setup (formatted as ours), never as raw stderr or, at WARNING and above,
    as Python's bare last-resort lines of a process that set up no logging.

    DEBUG, because they are not news to a person: each connection attempt of an outage and what it
    failed (``FAIL``, ``Connect to ... failed``, ``N/N brokers are down``, a request's ``Broker transport
    failure``: the outage itself is told once, by ``infra.outage``), and a retry the client resolves by
    itself (``Coordinator load in progress: retrying`` while a fresh broker loads its coordinator, a
    group session lost to an outage and rejoined)."""

    SELF_RESOLVING = re.compile(r"retrying|will retry|Coordinator load in progress|rejoining group", re.I)
    ATTEMPT_FACILITIES = frozenset({"FAIL", "BROKERFAIL", "REQTMOUT"})
    ATTEMPT = re.compile(r"Connect to .* failed|Connection refused|Disconnected|brokers are down|"
                         r"Failed to resolve|Receive failed|Send failed|Timed out \d+ in-flight|"
                         r"Broker transport failure|All broker connections are down", re.I)

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def log(self, level: int, msg: str, *args: Any) -> None:
        """confluent-kafka's call: ``log(level, "%s [%s] %s", facility, client name, text)``."""
        if level > logging.DEBUG:
            facility, text = (str(args[0]), str(args[-1])) if len(args) == 3 else ("", msg)
            if facility in self.ATTEMPT_FACILITIES or self.ATTEMPT.search(text) or \
                    (level < logging.ERROR and self.SELF_RESOLVING.search(text)):
                level = logging.DEBUG
        self.logger.log(level, msg, *args)


def connection_config(servers: str | KafkaConnection, settings: Mapping[str, Any] | None = None
                      ) -> dict[str, Any]:
    """The connection as librdkafka properties, then the client's own ``settings`` (which win: they say
    what the client is for); its ``logger`` (default ``trajbus.kafka``) wrapped in ``ClientLog``."""
    config = {**KafkaConnection.of(servers).librdkafka(), **(settings or {})}
    logger = config.get("logger") or logging.getLogger(CLIENT_LOGGER)
    config["logger"] = logger if isinstance(logger, ClientLog) else ClientLog(logger)
    return config


def role_settings(role: str, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``COMMON``, the role's defaults, then ``settings`` (the call site's own, which win)."""
    return {**COMMON, **ROLE_DEFAULTS[role], **(settings or {})}


def reader_settings(settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A reader's settings. librdkafka wants a group id even for a consumer that never joins one: a
    unique one unless ``settings`` names one (a probe of a group's commits names it)."""
    return role_settings("reader", {"group.id": f"trajbus.reader.{uuid.uuid4().hex[:8]}", **(settings or {})})
