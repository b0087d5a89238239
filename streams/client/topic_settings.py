"""The one settings object that sizes trajbus's topics: partition counts, retention, replication.

Names are the wire's (``streams.wire.topics``); how many partitions a topic has and how long it keeps
records is the cluster's business, which ``infra.topics`` provisions from the specs built here.
"""

from __future__ import annotations

from dataclasses import dataclass

from trajbus.infra.topics import CLUSTER_DEFAULT, TopicSpec
from trajbus.streams.wire.topics import (DEFAULT_CHANNELS, DEFAULT_PREFIX, chunks_topic, dlq_topic, groups_topic,
                                         policy_topic, prompts_topic, stats_topic, steps_topic, traces_topic,
                                         trained_topic, validate_prefix)

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
