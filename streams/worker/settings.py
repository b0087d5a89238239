"""What the stream processor does, per channel: group size, filters, timeouts, queue bound."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

from trajbus.infra.arguments import positive_float, positive_int
from trajbus.infra.declared import setting
from trajbus.infra.dotted import import_dotted
from trajbus.infra.shared_settings import outage_limit_setting, tracing_setting
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.topics import DEFAULT_CHANNELS, validate_channel

STALE_ACTIONS = ("drop", "tag")
ENV_PREFIX = "TRAJBUS_WORKER_"
"""The worker's settings (its own and the channels' defaults) as environment variables."""


@dataclass(frozen=True)
class ChannelSettings:
    """Assembly and filtering rules of one channel; every field has a safe default.

    Each field is a worker flag (the default of every channel), a ``--channel-setting
    CHANNEL.FIELD=VALUE`` (one channel) and a ``TRAJBUS_WORKER_<FIELD>`` variable."""

    n_rollouts: int = setting(4, parse=positive_int, help="group size when a group registers none")
    max_staleness: int | None = setting(
        None, help="drop (or tag) groups whose oldest policy_version is more than N behind the policy topic")
    stale_action: str = setting("drop", choices=STALE_ACTIONS, help="what happens to a stale group")
    drop_equal_rewards: bool = setting(
        False, help="drop groups whose trajectories all have the same reward: GRPO learns nothing from them")
    group_filter: str | None = setting(
        None, help="dotted path of f(group: ReadyGroup) -> bool | (bool, reason); False drops the group")
    group_timeout: float | None = setting(
        None, parse=positive_float, help="seconds from a group's first event until it is emitted partially or dropped")
    min_rollouts: int = setting(
        1, parse=positive_int, help="complete trajectories a timed-out group needs to be emitted as partial")
    max_group_bytes: int = setting(
        256 * 2**20, parse=positive_int,
        help="bytes of the largest group record carried (in chunks past max.message.bytes); a larger one goes "
             "to the DLQ")
    max_queue_size: int | None = setting(
        None, parse=positive_int,
        help="ready groups the trainer may fall behind before the oldest are dropped from the log")

    def __post_init__(self) -> None:
        def positive(name: str, value: Any, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")

        positive("n_rollouts", self.n_rollouts)
        positive("min_rollouts", self.min_rollouts)
        positive("max_group_bytes", self.max_group_bytes)
        positive("max_queue_size", self.max_queue_size, allow_none=True)
        if self.max_staleness is not None and (type(self.max_staleness) is not int or self.max_staleness < 0):
            raise ValueError(f"max_staleness: must be a non-negative integer, got {self.max_staleness!r}")
        if self.stale_action not in STALE_ACTIONS:
            raise ValueError(f"stale_action: must be one of {STALE_ACTIONS}, got {self.stale_action!r}")
        if self.group_timeout is not None and not (
                type(self.group_timeout) in (int, float) and self.group_timeout > 0):
            raise ValueError(f"group_timeout: must be a positive number of seconds, got {self.group_timeout!r}")
        if self.group_filter is not None:
            self.load_group_filter()  # fail at start-up, not at the first ready group

    def load_group_filter(self) -> Callable | None:
        if self.group_filter is None:
            return None
        function = import_dotted(self.group_filter, "group_filter")
        if not callable(function):
            raise ValueError(f"group_filter: {self.group_filter!r} is not callable")
        return function

    def replace(self, **changes: Any) -> "ChannelSettings":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not a channel setting")
        return dataclasses.replace(self, **changes)


@dataclass
class WorkerSettings:
    """The stream processor's settings: topics, channels, and each channel's rules."""

    topics: TopicSettings = field(default_factory=TopicSettings)
    channels: tuple[str, ...] = DEFAULT_CHANNELS
    default: ChannelSettings = field(default_factory=ChannelSettings)
    overrides: dict[str, ChannelSettings] = field(default_factory=dict)
    stats_interval: float = setting(
        2.0, parse=positive_float, help="seconds between statistics snapshots (Kafka topic and Prometheus gauges)")
    metrics_port: int | None = setting(None, help="serve Prometheus metrics on this port (0: any free port)")
    metrics_host: str = setting(
        "127.0.0.1", help="interface of the metrics server (0.0.0.0 in a container, for the scraper)")
    emitted_ttl: float = setting(
        24 * 3600.0, parse=positive_float,
        help="seconds an emitted group is remembered: its late events go to the DLQ, not into a new group")
    step_cache_bytes: int = setting(
        1 << 30, parse=positive_int,
        help="bytes of pending groups' steps kept in memory as they arrive; past it the oldest are read back "
             "from the steps topic when their group is emitted")
    broker_outage_limit: float = outage_limit_setting("worker")
    tracing: str = tracing_setting("worker")
    unassigned_timeout: float = setting(
        30.0, parse=positive_float,
        help="seconds a topic the worker reads may stay out of its group's assignment (an assignment made "
             "while the broker did not know the topic) before the worker rejoins the group to get its partitions")
    faust_loglevel: str = setting("WARNING", help="log level of Faust and its Kafka clients")

    def __post_init__(self) -> None:
        if isinstance(self.channels, str):
            raise ValueError(f"channels: a sequence of channel names, not the string {self.channels!r}")
        self.channels = tuple(dict.fromkeys(validate_channel(c) for c in self.channels))  # once each
        if not self.channels:
            raise ValueError("channels: at least one channel is needed")
        for channel in self.overrides:
            if channel not in self.channels:
                raise ValueError(f"channel: settings given for {channel!r}, which the worker does not process")

    @property
    def app_id(self) -> str:
        """The Faust app id, hence the consumer group and the table's changelog topic.

        It names the channel set: workers share partitions only with workers of the same
        channels (a worker handed a partition of a channel it does not serve would stall it).
        """
        channels = ".".join(sorted(self.channels))
        if len(channels) > 100:
            channels = hashlib.sha1(channels.encode()).hexdigest()[:12]
        return f"{self.topics.prefix}-worker-{channels}"

    def channel(self, channel: str) -> ChannelSettings:
        return self.overrides.get(channel, self.default)
