"""The Faust stream processor: step events in, ready prompt groups out.

One agent consumes ``{prefix}.steps.{channel}`` of every configured channel. The
assembly state of each prompt group lives in the Faust table ``pending`` (keyed
``channel/prompt_uid``, backed by a changelog topic, so a restarted worker
recovers it); ``emitted`` remembers which groups went out, so a redelivered or
late event never emits a group twice. A group is written to
``{prefix}.groups.{channel}`` the moment it is ready, whatever older groups still
wait: FIFO by readiness, no head-of-line blocking. Anything that cannot be
processed goes to ``{prefix}.dlq`` with the reason in a header.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import faust

from streams import codec
from streams.dlq import dlq_headers
from streams.assembly import Outcome, PendingGroup
from streams.records import ReadyGroup, Step, TrajectoryEnd
from streams.topics import (
    DEFAULT_CHANNELS,
    TopicSettings,
    channel_of,
    dlq_topic,
    groups_topic,
    steps_topic,
    validate_channel,
)

log = logging.getLogger("trajbus.worker")


@dataclass
class WorkerSettings:
    """What the stream processor does; topic sizes come from ``topics``."""

    topics: TopicSettings = field(default_factory=TopicSettings)
    channels: tuple[str, ...] = DEFAULT_CHANNELS
    default_n_rollouts: int = 4
    channel_n_rollouts: dict[str, int] = field(default_factory=dict)
    """Per-channel default group size, overriding ``default_n_rollouts``."""

    def __post_init__(self) -> None:
        self.channels = tuple(validate_channel(c) for c in self.channels)
        if not self.channels:
            raise ValueError("channels: at least one channel is needed")
        for name, size in {"default_n_rollouts": self.default_n_rollouts, **self.channel_n_rollouts}.items():
            if type(size) is not int or size < 1:
                raise ValueError(f"n_rollouts for {name}: must be a positive integer, got {size!r}")

    @property
    def app_id(self) -> str:
        return f"{self.topics.prefix}-worker"

    def n_rollouts_for(self, channel: str) -> int:
        return self.channel_n_rollouts.get(channel, self.default_n_rollouts)


@dataclass
class WorkerStats:
    """Counters of this worker process since it started."""

    events: Counter = field(default_factory=Counter)

    def count(self, channel: str, what: str, n: int = 1) -> None:
        self.events[(channel, what)] += n


def _broker_urls(bootstrap_servers: str) -> list[str]:
    return [f"kafka://{server.strip()}" for server in bootstrap_servers.split(",") if server.strip()]


def _group_key(channel: str, prompt_uid: str) -> bytes:
    return f"{channel}/{prompt_uid}".encode()


def build_app(bootstrap_servers: str, settings: WorkerSettings) -> tuple[faust.App, WorkerStats]:
    """A Faust app wired for ``settings``; run it with ``streams.worker.run_worker``."""
    stats = WorkerStats()
    prefix = settings.topics.prefix
    app = faust.App(
        settings.app_id,
        broker=_broker_urls(bootstrap_servers),
        store="memory://",  # tables are rebuilt from their changelog topics on start
        topic_partitions=settings.topics.steps_partitions,
        topic_replication_factor=settings.topics.replication_factor,
        topic_disable_leader=True,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        # Latency over batching: a group should be fetchable milliseconds after its
        # last step. Fetches return as soon as data exists, the producer sends at
        # once, processing starts right after recovery, and offsets are committed
        # every 100 events or 0.5 s (a redelivery after a crash is absorbed by the
        # `emitted` table, so a short commit interval buys little).
        producer_linger=0.0,
        stream_wait_empty=False,
        stream_recovery_delay=0.0,
        broker_commit_every=100,
        broker_commit_interval=0.5,
        producer_max_request_size=settings.topics.max_message_bytes,
        consumer_max_fetch_size=settings.topics.max_message_bytes,
    )
    source = app.topic(*(steps_topic(c, prefix) for c in settings.channels),
                       key_serializer="raw", value_serializer="raw")
    outputs = {c: app.topic(groups_topic(c, prefix), key_serializer="raw", value_serializer="raw")
               for c in settings.channels}
    dlq = app.topic(dlq_topic(prefix), key_serializer="raw", value_serializer="raw")
    # bytes keys and values: Faust stores them raw; the values use our own codec.
    pending = app.Table("pending", key_type=bytes, value_type=bytes, partitions=settings.topics.steps_partitions)
    emitted = app.Table("emitted", key_type=bytes, value_type=bytes, partitions=settings.topics.steps_partitions)

    async def to_dlq(event: faust.EventT, channel: str, reason: str) -> None:
        message = event.message
        headers = dlq_headers(message.headers, reason, message.topic, message.partition, message.offset)
        await dlq.send(key=message.key, value=message.value, headers=headers)
        stats.count(channel, "dlq")
        log.warning("dlq topic=%s partition=%d offset=%d reason=%s",
                    message.topic, message.partition, message.offset, reason)

    async def handle(event: faust.EventT) -> None:
        message = event.message
        channel = channel_of(message.topic, prefix)
        try:
            record = codec.decode(message.value)
            if not isinstance(record, (Step, TrajectoryEnd)):
                raise codec.DecodeError(f"a {type(record).__name__} does not belong on a steps topic")
            record.validate()
        except ValueError as exc:
            await to_dlq(event, channel, f"undecodable: {exc}")
            return
        if record.channel is not None and record.channel != channel:
            await to_dlq(event, channel, f"channel mismatch: record says {record.channel!r}, topic is {channel!r}")
            return
        stats.count(channel, "events_in")
        key = _group_key(channel, record.prompt_uid)
        if emitted.get(key) is not None:
            await to_dlq(event, channel, "late: group already emitted")
            return
        stored = pending.get(key)
        group = PendingGroup.from_record(codec.decode(stored)) if stored is not None \
            else PendingGroup(prompt_uid=record.prompt_uid, channel=channel)
        default_size = settings.n_rollouts_for(channel)
        outcome = group.add(record, default_size)
        if outcome is Outcome.UNKNOWN_TRAJECTORY:
            await to_dlq(event, channel, f"unknown trajectory: {record.trajectory_uid} has no steps")
            return
        if outcome is Outcome.DUPLICATE:
            stats.count(channel, "duplicates")
            return
        if outcome is Outcome.READY:
            ready: ReadyGroup = group.to_ready_group(default_size)
            ready.ready_at = time.time()
            await outputs[channel].send(key=record.prompt_uid.encode(), value=codec.encode(ready),
                                        headers=codec.headers_for(ready))
            emitted[key] = str(ready.ready_at).encode()
            del pending[key]
            stats.count(channel, "groups_emitted")
            log.info("group ready channel=%s prompt_uid=%s trajectories=%d steps=%d",
                     channel, record.prompt_uid, len(ready.trajectory_uids), len(ready.steps))
            return
        pending[key] = codec.encode(group.to_record())

    @app.agent(source)
    async def assemble(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await handle(event)

    return app, stats
