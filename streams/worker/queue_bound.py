"""The ready-group queue bound: the trainer's lag per channel, and past ``max_queue_size`` the oldest out.

Retention is the backpressure: a trainer that falls behind by more than a channel's
``max_queue_size`` groups loses the oldest (freshest data wins), counted as
``queue_full`` drops; the depth is a gauge either way. One worker (the owner of
source partition 0) runs it, so drops are counted once.
"""

from __future__ import annotations

import asyncio
import logging

from trajbus.infra.group_lag import consumer_group_lag
from trajbus.infra.topics import delete_records_before
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.stats import WorkerMetrics
from trajbus.streams.wire.topics import groups_topic, trainer_group_id
from trajbus.streams.worker.logs import FailureStreak

log = logging.getLogger("trajbus.worker")


class QueueBound:
    """The bound of every channel's queue, checked once a tick; a channel whose depth Kafka does not tell
    (a coordinator away) is told once per streak (``FailureStreak``), and the others are bounded anyway."""

    def __init__(self, bootstrap_servers: str, settings: WorkerSettings, metrics: WorkerMetrics) -> None:
        self.bootstrap_servers, self.settings, self.metrics = bootstrap_servers, settings, metrics
        self.streaks = {channel: FailureStreak(f"the queue depth of {groups_topic(channel, settings.topics.prefix)}",
                                               log) for channel in settings.channels}

    async def check(self) -> None:
        for channel in self.settings.channels:
            try:
                await self.bound(channel)
            except Exception as exc:  # noqa: BLE001 - a slow broker must not stop assembly
                self.streaks[channel].failed(exc)
            else:
                self.streaks[channel].succeeded()

    async def bound(self, channel: str) -> None:
        """Queue depth of one channel; past ``max_queue_size``, its oldest ready groups leave the log."""
        limit = self.settings.channel(channel).max_queue_size
        topic = groups_topic(channel, self.settings.topics.prefix)
        lags = await asyncio.to_thread(consumer_group_lag, self.bootstrap_servers,
                                       trainer_group_id(channel, self.settings.topics.prefix), topic)
        depth = sum(lag.lag for lag in lags)
        if limit is not None:
            for lag in lags:
                share = max(1, limit // len(lags))
                if lag.lag > share:
                    start = await asyncio.to_thread(delete_records_before, self.bootstrap_servers, topic,
                                                    lag.partition, lag.high - share)
                    dropped = start - lag.position
                    depth -= dropped
                    self.metrics.dropped.labels(channel, "queue_full").inc(dropped)
                    log.warning("queue full channel=%s partition=%d dropped=%d oldest groups (limit %d)",
                                channel, lag.partition, dropped, limit)
        self.metrics.queue_depth.labels(channel).set(depth)
