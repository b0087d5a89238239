"""A trainer's channel must exist: a misspelled one is an error, not fetches that wait forever.

A ``BatchConsumer`` subscribed to a channel whose groups topic does not exist would wait out every fetch
and return ``None``, as if no group were ready yet. A trainer may start a little before the worker that
creates its topics, so the topic gets ``CHANNEL_GRACE`` seconds from the consumer's first fetch to appear;
past that, a fetch still without it lists the cluster's topics and raises ``UnknownChannel``, naming the
channels there are and the command that creates the missing one. That is the gateway's rule
(``gateway.broker.channels``): a channel is created explicitly, by ``trajbus topics --create`` or a worker started
for it. Once the topic was there (listed, or partitions of it assigned), nothing more is asked: a
restarted broker's passing "unknown topic" is no misspelling.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import KafkaException

from trajbus.streams.wire.topics import channels_in, unknown_channel_fix

log = logging.getLogger(__name__)

LIST_TIMEOUT = 10.0
"""Seconds the cluster has to list its topics (it has just answered the consumer)."""
CHANNEL_GRACE = 30.0
"""Seconds from a consumer's first fetch for its channel's topics to appear (a worker starting beside it)."""
ASK_EVERY = 5.0
"""Seconds between two listings while a fetch waits past the grace (a cluster that did not answer one)."""


class UnknownChannel(LookupError):
    """The channel has no groups topic on the cluster: no group of it can arrive (a misspelled name, a wrong
    prefix, or a channel never created)."""


class ChannelCheck:
    """Whether a consumer's groups topic exists, asked of the cluster past the grace, until it was seen."""

    def __init__(self, consumer: Any, topic: str, channel: str, prefix: str, servers: str,
                 grace: float = CHANNEL_GRACE) -> None:
        self.consumer, self.topic, self.channel, self.prefix, self.servers = consumer, topic, channel, prefix, servers
        self.grace = grace
        self.seen = False
        self._since: float | None = None
        self._asked_at = float("-inf")

    def fetching(self) -> None:
        """A fetch began: the grace counts from the first."""
        if self._since is None:
            self._since = time.monotonic()

    def saw(self) -> None:
        self.seen = True

    def check(self) -> None:
        """Past the grace, while the topic was never seen: raise ``UnknownChannel`` if the cluster lists no such
        topic (a cluster that does not list its topics in time leaves the fetch waiting)."""
        now = time.monotonic()
        if self.seen or self._since is None or now - self._since < self.grace or now - self._asked_at < ASK_EVERY:
            return
        self._asked_at = now
        self.seen = require_channel(self.consumer, self.topic, self.channel, self.prefix, self.servers)


def require_channel(consumer: Any, topic: str, channel: str, prefix: str, servers: str) -> bool:
    """True when ``topic`` (the channel's groups topic) is among the cluster's topics, False when they could not
    be listed; ``UnknownChannel`` when it is not there."""
    try:
        topics = consumer.list_topics(timeout=LIST_TIMEOUT).topics
    except KafkaException as exc:
        log.warning("could not list the topics at %s to check channel %r: %s", servers, channel, exc)
        return False
    if topic in topics and topics[topic].error is None:
        return True
    there = channels_in(topics, prefix, kind="groups")
    known = (f"channels there: {', '.join(there)}" if there else
             f"no channel there under prefix {prefix!r}: is the prefix right?")
    raise UnknownChannel(f"channel {channel!r}: there is no topic {topic} at {servers}, so no group of it can "
                         f"arrive ({known}); {unknown_channel_fix(channel, prefix)}")
