"""The trainer's current policy version on ``{prefix}.policy``: publishing it, and following it.

The record, its keys and which key speaks for a channel are the wire's (``streams.wire.policy``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from confluent_kafka import TopicPartition
from trajbus.infra.clients import acked_producer, reader

from trajbus.streams.client.delivery import produce_acked
from trajbus.streams.wire.headers import content_type_headers
from trajbus.streams.wire.policy import (CONTENT_TYPE, GLOBAL, decode_policy_version, encode_policy_version,
                                         policy_key, serving_version, trainer_version)
from trajbus.streams.wire.topics import DEFAULT_PREFIX, policy_topic

if TYPE_CHECKING:
    from trajbus.streams.client.weight_update import UpdateReport

log = logging.getLogger(__name__)


class PolicyVersionPublisher:
    """The trainer's side: ``publish(version)`` after each update; returns once acknowledged. With
    gateways in front of the engines, ``update(version, load, gateways)`` does the whole update."""

    def __init__(self, bootstrap_servers: str, prefix: str = DEFAULT_PREFIX, channel: str = GLOBAL,
                 timeout: float = 30.0, serving: bool = False) -> None:
        self.topic = policy_topic(prefix)
        self.channel = channel
        self.key = policy_key(channel, serving)
        """``serving=True``: the version the engines serve (weight sync), not the trainer's."""
        self.timeout = timeout
        self._producer = acked_producer(bootstrap_servers, {"logger": log})

    def publish(self, version: int) -> None:
        # A refusal (e.g. the policy topic does not exist: provision the channel first) is a DeliveryError.
        produce_acked(self._producer, self.topic, [(self.key.encode(), encode_policy_version(version),
                                                    content_type_headers(CONTENT_TYPE))], self.timeout)

    def update(self, version: int, load: Callable[[], object] | None = None, gateways: Sequence[str] = (),
               api_key: str | None = None, drain: bool = False) -> "UpdateReport":
        """Pause every gateway (generations in flight are cut, their tokens kept), ``load()`` the new
        weights into the engines, publish ``version``, resume every gateway at it (cut generations
        continue under the new weights); ``drain``: wait for generations in flight instead of cutting
        them. See ``streams.client.weight_update``."""
        from trajbus.streams.client.weight_update import GatewayUpdates  # HTTP: only for a trainer that updates

        updates = GatewayUpdates(gateways, api_key)
        try:
            return updates.run(version, load, self.publish, drain)
        finally:
            updates.close()

    def close(self) -> None:
        self._producer.close()

    def __enter__(self) -> "PolicyVersionPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PolicyWatcher:
    """Follows the policy topic in a background thread; ``current`` is a dict look-up."""

    def __init__(self, bootstrap_servers: str, prefix: str = DEFAULT_PREFIX) -> None:
        self._versions: dict[str, int] = {}
        self._stop = threading.Event()
        self._consumer = reader(bootstrap_servers, {
            "group.id": f"{prefix}.policy-watcher", "fetch.wait.max.ms": 100, "logger": log})
        self._consumer.assign([TopicPartition(policy_topic(prefix), 0, 0)])
        self._thread = threading.Thread(target=self._run, name="policy-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self._consumer.poll(0.2)
            if message is None or message.error() or message.key() is None:
                continue
            try:
                self._versions[message.key().decode()] = decode_policy_version(message.value())
            except (ValueError, UnicodeDecodeError) as exc:
                log.warning("ignoring policy record at offset %d: %s", message.offset(), exc)
        self._consumer.close()

    def current(self, channel: str) -> int | None:
        """The trainer's newest version for ``channel`` (else ``global``), or None if none was published."""
        return trainer_version(self._versions, channel)

    def serving(self, channel: str) -> int | None:
        """The version the engines of ``channel`` serve: its ``serving.`` key, else the trainer's version."""
        return serving_version(self._versions, channel)

    def versions(self) -> dict[str, int]:
        """Every key's newest version seen so far."""
        return dict(self._versions)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
