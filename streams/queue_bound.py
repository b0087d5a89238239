"""The ready-group queue bound: the trainer's lag per channel, and past ``max_queue_size`` the oldest out.

Retention is the backpressure: a trainer that falls behind by more than a channel's
``max_queue_size`` groups loses the oldest (freshest data wins), counted as
``queue_full`` drops; the depth is a gauge either way. One worker (the owner of
source partition 0) runs it, so drops are counted once.
"""

from __future__ import annotations

import asyncio
import logging

from trajbus.infra.topics import consumer_group_lag, delete_records_before
from trajbus.streams.settings import WorkerSettings
from trajbus.streams.stats import WorkerMetrics
from trajbus.streams.topics import groups_topic, trainer_group_id

log = logging.getLogger("trajbus.worker")


async def bound_queues(bootstrap_servers: str, settings: WorkerSettings, metrics: WorkerMetrics) -> None:
    """Queue depth per channel; past ``max_queue_size``, the oldest ready groups leave the log."""
    prefix = settings.topics.prefix
    for channel in settings.channels:
        limit = settings.channel(channel).max_queue_size
        topic = groups_topic(channel, prefix)
        try:
            lags = await asyncio.to_thread(consumer_group_lag, bootstrap_servers, trainer_group_id(channel, prefix),
                                           topic)
        except Exception as exc:  # noqa: BLE001 - a slow broker must not stop assembly
            log.warning("queue depth of %s unavailable: %s", topic, exc)
            continue
        depth = sum(lag.lag for lag in lags)
        if limit is not None:
            for lag in lags:
                share = max(1, limit // len(lags))
                if lag.lag > share:
                    start = await asyncio.to_thread(delete_records_before, bootstrap_servers, topic, lag.partition,
                                                    lag.high - share)
                    dropped = start - lag.position
                    depth -= dropped
                    metrics.dropped.labels(channel, "queue_full").inc(dropped)
                    log.warning("queue full channel=%s partition=%d dropped=%d oldest groups (limit %d)",
                                channel, lag.partition, dropped, limit)
        metrics.queue_depth.labels(channel).set(depth)
