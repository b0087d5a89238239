"""Topic names, channel names, and the one settings object that sizes the topics.

``{prefix}.steps.{channel}``  step events, key = prompt_uid
``{prefix}.groups.{channel}`` ready prompt groups; retention is the backpressure
``{prefix}.chunks.{channel}`` the bytes of groups too large for one record (``streams.wire.chunks``)
``{prefix}.prompts.{channel}`` the prompt ledger: groups handed out and how each ended (compacted, ``streams.wire.ledger``)
``{prefix}.trained.{channel}`` the trained log: the groups of each trainer step (kept forever, ``streams.wire.trained``)
``{prefix}.policy``           the trainer's policy version (compacted)
``{prefix}.dlq``              records that could not be processed, with the reason
``{prefix}.stats``            statistics snapshots of the stream workers (compacted)
``{prefix}.traces``           spans of the components that trace (``--tracing kafka``, read by ``trajbus trace``)
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Iterable

from trajbus.infra.topics import CLUSTER_DEFAULT, TopicSpec

DEFAULT_PREFIX = "trajbus"
DEFAULT_CHANNELS = ("train", "val")

_CHANNEL = re.compile(r"[a-z0-9_-]{1,64}")
_PREFIX = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def validate_channel(channel: object) -> str:
    """Channel names become topic names, so they are restricted to ``[a-z0-9_-]{1,64}``."""
    if not isinstance(channel, str) or not _CHANNEL.fullmatch(channel):
        raise ValueError(f"channel: {channel!r} is not a valid channel name (expected [a-z0-9_-]{{1,64}})")
    return channel


def channel_setting(text: str) -> tuple[str, str, str]:
    """``CHANNEL.SETTING=VALUE`` (a per-channel flag) -> (channel, setting, value); argparse ``type=``."""
    target, sep, value = text.partition("=")
    channel, dot, name = target.partition(".")
    if not sep or not dot:
        raise argparse.ArgumentTypeError(f"expected CHANNEL.SETTING=VALUE, got {text!r}")
    try:
        validate_channel(channel)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return channel, name, value


def validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(f"prefix: {prefix!r} is not a valid topic prefix")
    return prefix


def steps_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}.steps.{validate_channel(channel)}"


def groups_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}.groups.{validate_channel(channel)}"


def chunks_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Chunks of group records too large for one record; the groups topic names them."""
    return f"{prefix}.chunks.{validate_channel(channel)}"


def prompts_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The prompt ledger of a channel (``streams.wire.ledger``): one partition, compacted."""
    return f"{prefix}.prompts.{validate_channel(channel)}"


def trained_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The trained log of a channel (created by the first trainer that records a step)."""
    return f"{prefix}.trained.{validate_channel(channel)}"


def policy_topic(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}.policy"


def dlq_topic(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}.dlq"


def stats_topic(prefix: str = DEFAULT_PREFIX) -> str:
    """Statistics snapshots of the stream workers (compacted, keyed by worker id)."""
    return f"{prefix}.stats"


def traces_topic(prefix: str = DEFAULT_PREFIX) -> str:
    """Finished spans of every component that traces to Kafka (``infra.tracing``), keyed by trajectory."""
    return f"{prefix}.traces"


def trainer_group_id(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The consumer group trainers read a channel's groups in; its lag is the queue depth."""
    return f"{prefix}.trainer.{validate_channel(channel)}"


def channels_in(topic_names: Iterable[str], prefix: str = DEFAULT_PREFIX, kind: str = "steps") -> list[str]:
    """The channels among ``topic_names`` that have a ``kind`` topic under ``prefix`` (``steps``: what a worker
    reads; ``groups``: what a trainer reads), sorted: what a refusal of an unknown channel names. Names that
    are no channel's (another prefix's, ``{prefix}.steps.Bad``) are passed over."""
    head = f"{prefix}.{kind}."
    return sorted({name[len(head):] for name in topic_names
                   if name.startswith(head) and _CHANNEL.fullmatch(name[len(head):])})


def unknown_channel_fix(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """What a refusal of a channel without topics tells to do: the command that creates them (``--prefix``
    named unless it is the default)."""
    command = f"trajbus topics --create --channels {channel}"
    command = command if prefix == DEFAULT_PREFIX else f"{command} --prefix {prefix}"
    return f"fix the name, or create the channel with `{command}` and run a worker for it"


def channel_of(topic: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The channel a steps or groups topic belongs to (``ValueError`` for other topics)."""
    for kind in ("steps", "groups"):
        head = f"{prefix}.{kind}."
        if topic.startswith(head):
            return validate_channel(topic[len(head):])
    raise ValueError(f"topic {topic!r} is not a trajbus steps or groups topic under prefix {prefix!r}")


_MiB = 1024 * 1024
_HOUR_MS = 3600 * 1000


@dataclass(frozen=True)
class TopicSettings:
    """Partition counts and topic configs of every trajbus topic.

    ``groups_partitions`` is 1 by default: one log per channel is what makes the
    trainer's view FIFO by readiness, and one partition carries far more groups
    per second than any trainer consumes. The groups topic's retention bounds
    (time and size) are enforced by the broker: stale data ages out whatever the
    producers do. Segments roll every minute so that those bounds bite promptly.

    The partition counts size the topics these settings create; an existing topic keeps
    its count (``infra.topics``: only ``trajbus topics --create`` with the flag raises one).

    ``replication_factor`` and ``min_insync_replicas`` are the cluster's defaults unless
    set (None): a managed cluster's topics get its replication, the embedded single
    broker's get one replica.
    """

    prefix: str = DEFAULT_PREFIX
    steps_partitions: int = 8
    groups_partitions: int = 1
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    max_message_bytes: int = 16 * _MiB
    steps_retention_ms: int = 7 * 24 * _HOUR_MS
    groups_retention_ms: int = 6 * _HOUR_MS
    groups_retention_bytes: int = 1024 * _MiB
    groups_segment_ms: int = 60 * 1000
    groups_segment_bytes: int = 64 * _MiB
    dlq_retention_ms: int = 7 * 24 * _HOUR_MS
    traces_retention_ms: int = 7 * 24 * _HOUR_MS

    def __post_init__(self) -> None:
        validate_prefix(self.prefix)
        for name in ("steps_partitions", "groups_partitions", "replication_factor", "min_insync_replicas"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if None not in (self.replication_factor, self.min_insync_replicas) and \
                self.min_insync_replicas > self.replication_factor:
            raise ValueError(f"min_insync_replicas: {self.min_insync_replicas} is above the replication factor "
                             f"{self.replication_factor}: no write could be acknowledged")

    def spec(self, name: str, partitions: int, config: dict[str, str]) -> TopicSpec:
        """A topic with this settings' replication (the cluster's defaults where unset)."""
        if self.min_insync_replicas is not None:
            config = {**config, "min.insync.replicas": str(self.min_insync_replicas)}
        return TopicSpec(name, partitions, config, self.replication_factor or CLUSTER_DEFAULT)

    def table_spec(self, name: str, partitions: int) -> TopicSpec:
        """The changelog of a worker's table: compacted, replicated like every other topic."""
        return self.spec(name, partitions, {"cleanup.policy": "compact",
                                            "max.message.bytes": str(self.max_message_bytes)})

    def channel_specs(self, channel: str) -> list[TopicSpec]:
        """The topics every channel has. Chunks are kept as long as the groups that name them; the prompt
        ledger is one ordered log, compacted (never deleted by age: it is the data sources' state)."""
        common = {"max.message.bytes": str(self.max_message_bytes)}
        queue = {
            **common,
            "cleanup.policy": "delete",
            "retention.ms": str(self.groups_retention_ms),
            "retention.bytes": str(self.groups_retention_bytes),
            "segment.ms": str(self.groups_segment_ms),
            "segment.bytes": str(self.groups_segment_bytes),
        }
        return [
            self.spec(steps_topic(channel, self.prefix), self.steps_partitions, {
                **common, "retention.ms": str(self.steps_retention_ms), "cleanup.policy": "delete",
            }),
            self.spec(groups_topic(channel, self.prefix), self.groups_partitions, queue),
            self.spec(chunks_topic(channel, self.prefix), self.groups_partitions, queue),
            self.spec(prompts_topic(channel, self.prefix), 1, {**common, "cleanup.policy": "compact"}),
        ]

    def trained_spec(self, channel: str) -> TopicSpec:
        """The trained log: one ordered partition, never deleted by age or size (a run's audit reads it whole)."""
        return self.spec(trained_topic(channel, self.prefix), 1, {"cleanup.policy": "delete", "retention.ms": "-1",
                                                                  "retention.bytes": "-1"})

    def shared_specs(self) -> list[TopicSpec]:
        """The topics shared by all channels."""
        return [
            self.spec(policy_topic(self.prefix), 1, {"cleanup.policy": "compact"}),
            self.spec(dlq_topic(self.prefix), 1, {
                "max.message.bytes": str(self.max_message_bytes),
                "retention.ms": str(self.dlq_retention_ms),
            }),
            self.spec(stats_topic(self.prefix), 1, {"cleanup.policy": "compact"}),
            self.spec(traces_topic(self.prefix), 1, {"cleanup.policy": "delete",
                                                     "retention.ms": str(self.traces_retention_ms)}),
        ]

    def specs(self, channels: tuple[str, ...] | list[str] = DEFAULT_CHANNELS) -> list[TopicSpec]:
        return self.shared_specs() + [spec for channel in channels for spec in self.channel_specs(channel)]
