"""The trainer's current policy version on ``{prefix}.policy`` (compacted).

Key: a channel name, or ``global`` for every channel: the version the trainer
has reached. Key ``serving.<channel>`` or ``serving.global``: the version the
inference engines serve, when their weights lag the trainer's (published by
whatever syncs them); without one, engines are taken to serve the trainer's
version. Value: UTF-8 JSON ``{"version": <int>, "published_at": <unix seconds>}``.
Readers take the newest value of the channel's key, else of ``global``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

from confluent_kafka import TopicPartition
from trajbus.infra.clients import acked_producer, reader

from trajbus.streams.client.delivery import produce_acked
from trajbus.streams.wire.topics import DEFAULT_PREFIX, policy_topic

if TYPE_CHECKING:
    from trajbus.streams.client.weight_update import UpdateReport

log = logging.getLogger(__name__)

GLOBAL = "global"
SERVING = "serving."
"""Key prefix of the version the inference engines serve."""
CONTENT_TYPE = "application/json; schema=trajbus.policy-version; v=1"


def encode_policy_version(version: int) -> bytes:
    if type(version) is not int:
        raise ValueError(f"version: must be an integer, got {version!r}")
    return json.dumps({"version": version, "published_at": time.time()}).encode()


def decode_policy_version(value: bytes) -> int:
    try:
        version = json.loads(value)["version"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a policy version record: {exc}") from None
    if type(version) is not int:
        raise ValueError(f"policy version is not an integer: {version!r}")
    return version


class PolicyVersionPublisher:
    """The trainer's side: ``publish(version)`` after each update; returns once acknowledged. With
    gateways in front of the engines, ``update(version, load, gateways)`` does the whole update."""

    def __init__(self, bootstrap_servers: str, prefix: str = DEFAULT_PREFIX, channel: str = GLOBAL,
                 timeout: float = 30.0, serving: bool = False) -> None:
        self.topic = policy_topic(prefix)
        self.channel = channel
        self.key = f"{SERVING}{channel}" if serving else channel
        """``serving=True``: the version the engines serve (weight sync), not the trainer's."""
        self.timeout = timeout
        self._producer = acked_producer(bootstrap_servers, {"logger": log})

    def publish(self, version: int) -> None:
        # A refusal (e.g. the policy topic does not exist: provision the channel first) is a DeliveryError.
        produce_acked(self._producer, self.topic, [(self.key.encode(), encode_policy_version(version),
                                                    [("content-type", CONTENT_TYPE.encode())])], self.timeout)

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
        version = self._versions.get(channel)
        return self._versions.get(GLOBAL) if version is None else version

    def serving(self, channel: str) -> int | None:
        """The version the engines of ``channel`` serve: its ``serving.`` key, else the trainer's version."""
        version = self._versions.get(SERVING + channel, self._versions.get(SERVING + GLOBAL))
        return self.current(channel) if version is None else version

    def versions(self) -> dict[str, int]:
        """Every key's newest version seen so far."""
        return dict(self._versions)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
