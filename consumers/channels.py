"""A trainer's channel must exist: a misspelled one is an error at the first fetch, not a fetch that waits.

A ``BatchConsumer`` subscribed to a channel whose groups topic does not exist would wait out every fetch
and return ``None``, as if no group were ready yet. The cluster says so to the consumer (librdkafka's
"Subscribed topic not available", about a second into its first fetch); the cluster's topics are then
listed to confirm it, and ``UnknownChannel`` is raised, naming the channels there are and the command that
creates the missing one. That is the gateway's rule
(``gateway.channels``): a channel is created explicitly, by ``trajbus topics --create`` or a worker started
for it. Nothing more is asked of the cluster unless it says the topic is missing.
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import KafkaException

from trajbus.streams.wire.topics import channels_in, unknown_channel_fix

log = logging.getLogger(__name__)

LIST_TIMEOUT = 10.0
"""Seconds the cluster has to list its topics (it has just answered the consumer)."""


class UnknownChannel(LookupError):
    """The channel has no groups topic on the cluster: no group of it can arrive (a misspelled name, a wrong
    prefix, or a channel never created)."""


def require_channel(consumer: Any, topic: str, channel: str, prefix: str, servers: str) -> None:
    """Raise ``UnknownChannel`` unless ``topic`` (the channel's groups topic) is among the cluster's topics;
    a cluster that does not list them in time leaves the fetch waiting, as it would without this check."""
    try:
        topics = consumer.list_topics(timeout=LIST_TIMEOUT).topics
    except KafkaException as exc:
        log.warning("could not list the topics at %s to check channel %r: %s", servers, channel, exc)
        return
    if topic in topics and topics[topic].error is None:
        return
    there = channels_in(topics, prefix, kind="groups")
    known = (f"channels there: {', '.join(there)}" if there else
             f"no channel there under prefix {prefix!r}: is the prefix right?")
    raise UnknownChannel(f"channel {channel!r}: there is no topic {topic} at {servers}, so no group of it can "
                         f"arrive ({known}); {unknown_channel_fix(channel, prefix)}")
