"""When a trainer consumer's silence becomes an outage error.

``BatchConsumer`` fetches; this part decides when a fetch that hears nothing should give up. While
nothing arrives, the one outage rule (``infra.outage.OutageWatch``) is asked every few seconds,
probed by a metadata request of the consumer's own: the trainer rides through an outage
(librdkafka reconnects) and only one past its limit raises.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import KafkaException

from trajbus.infra.outage import KafkaUnreachable, OutageWatch


class ContactWatch:
    """When ``consumer`` last heard its cluster, and whether a silence has lasted too long
    (``outage_limit`` None: an outage is ridden through forever, no rule is asked)."""

    def __init__(self, consumer: Any, topic: str, bootstrap_servers: str, outage_limit: float | None) -> None:
        self._consumer = consumer
        self._topic = topic
        self.bootstrap_servers = bootstrap_servers
        self._last_contact = time.monotonic()
        self._outage = None if outage_limit is None else OutageWatch(
            bootstrap_servers, outage_limit, what="trainer", setting="outage_limit", consequence=None,
            reachable=self._reachable)
        """The outage rule, asked while fetches wait (``check``); no thread of its own."""

    def heard(self) -> None:
        """The cluster answered (a first contact, a fetched message): a silence starts now."""
        self._last_contact = time.monotonic()

    def check(self, deadline: float | None) -> None:
        """While nothing arrives, ask the broker every few seconds whether it is there, by the one outage
        rule (``infra.outage.OutageWatch``): the trainer rides through an outage (librdkafka reconnects)
        and gets ``KafkaUnreachable`` past ``outage_limit``. The question waits no later than the fetch's
        ``deadline`` (a second at least)."""
        if self._outage is None or time.monotonic() - self._last_contact < self._outage.interval:
            return
        every = self._outage.interval
        reason = self._outage.check(every if deadline is None else min(every, max(1.0, deadline - time.monotonic())))
        self._last_contact = time.monotonic()
        if reason is not None:
            raise KafkaUnreachable(f"{reason}: no broker of {self.bootstrap_servers} answers")

    def _reachable(self, timeout: float) -> bool:
        """The outage rule's probe: a metadata request of the consumer's own."""
        try:
            self._consumer.list_topics(self._topic, timeout=timeout)
            return True
        except KafkaException:
            return False
