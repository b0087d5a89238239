"""The worker's place in its group, in one line: when it is ready, and after each rebalance.

A second ``trajbus worker`` of the same prefix and channels joins the first one's consumer group
(``WorkerSettings.app_id``) and the two split the steps partitions: that is how workers scale.
It is said, not silent. Once an assignment is in and the table recovered, the worker asks Kafka
for the group's members (one DescribeGroups request) and says how many it shares the partitions
with and which partitions it holds. The first such line is the ready line: where the worker is
(bootstrap servers, prefix, channels, group) and how long it rides through a Kafka outage.

No look-up is made while Kafka is known to be away: the announcement waits for the outage's end.
The look-up is kafka-python's (pure Python), not librdkafka's: librdkafka aborts the whole process
when a DescribeGroups request that timed out meets a broker coming back
(``rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0'``, confluentinc/librdkafka#4605).
A rebalance during a broker restart killed the worker that way, twice: once before the outage check,
and once after it, when the look-up began a moment before the outage was noticed (CI, five broker kills
in a row). A pure-Python client's timed-out request is an exception, never an abort.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

import faust
from kafka import KafkaAdminClient

from trajbus.infra.kafka_config import kafka_python_settings
from trajbus.infra.outage import cluster_outage
from trajbus.streams.worker.assignment_watch import held_by_channel
from trajbus.streams.worker.periodic import every

log = logging.getLogger("trajbus.worker")

DESCRIBE_TIMEOUT = 2.0
"""The group look-up's wait: without an answer the line says the group's size is unknown."""


def group_size(bootstrap_servers: str, group_id: str, timeout: float = DESCRIBE_TIMEOUT) -> int:
    """How many members Kafka counts in ``group_id`` now."""
    wait_ms = int(timeout * 1000)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers.split(","), client_id="trajbus-worker-membership",
                             request_timeout_ms=wait_ms, bootstrap_timeout_ms=wait_ms, **kafka_python_settings())
    try:
        group = admin.describe_groups([group_id])[group_id]
    finally:
        admin.close()
    if group.get("error"):
        raise RuntimeError(group["error"])
    return len(group["members"])


def spans(partitions: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` as ``0-3,6``."""
    runs: list[list[int]] = []
    for partition in sorted(partitions):
        if runs and partition == runs[-1][-1] + 1:
            runs[-1].append(partition)
        else:
            runs.append([partition])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def held_text(held: dict[str, set[int]], channels: Iterable[str]) -> str:
    """The steps partitions held, by channel: ``train 0-3, val none``."""
    return ", ".join(f"{channel} {spans(held[channel]) if held.get(channel) else 'none'}" for channel in channels)


def members_text(group: str, members: int | None) -> str:
    """This worker's place in its group, in words."""
    if members is None:
        return f"a worker of group {group} (its size unknown)"
    if members <= 1:
        return f"the only worker of group {group}"
    return f"one of {members} workers of group {group}, which share the steps partitions"


class Membership:
    """Says the worker's place in its group once per assignment (``assigned``, then ``announce``)."""

    def __init__(self, app: faust.App, assembler: Any) -> None:
        self.app, self.assembler = app, assembler
        self.pending = False
        self.said_ready = False

    def assigned(self) -> None:
        self.pending = True

    def due(self) -> bool:
        """An assignment not yet announced, its table recovered: the worker assembles."""
        return self.pending and not self.app.rebalancing and self.app.tables.recovery.completed.is_set()

    async def announce(self) -> None:
        if not self.due() or cluster_outage(self.assembler.bootstrap_servers).down_since is not None:
            return  # during an outage: announced once Kafka answers (no group look-up meanwhile)
        self.pending = False  # an assignment while Kafka is asked is announced in turn
        settings = self.assembler.settings
        try:
            members: int | None = await asyncio.to_thread(group_size, self.assembler.bootstrap_servers,
                                                          settings.app_id)
        except Exception as exc:  # noqa: BLE001 - the line goes out without the count
            log.debug("the group %s could not be described: %s", settings.app_id, exc)
            members = None
        held = held_text(held_by_channel(self.app, settings.topics.prefix, settings.channels), settings.channels)
        share = members_text(settings.app_id, members)
        if self.said_ready:
            log.info("rebalanced: %s; holds steps partitions %s", share, held)
            return
        self.said_ready = True
        log.info("worker ready: bootstrap %s, prefix %s, channels %s; %s; holds steps partitions %s; "
                 "rides through a Kafka outage for up to %gs (--broker-outage-limit)",
                 self.assembler.bootstrap_servers, settings.topics.prefix, ",".join(settings.channels), share,
                 held, settings.broker_outage_limit)


def announce_membership(app: faust.App, assembler: Any, interval: float = 1.0) -> Membership:
    """Wire a ``Membership`` into ``app``: each assignment is announced within ``interval`` s of the
    worker being ready."""
    membership = Membership(app, assembler)

    @app.on_partitions_assigned.connect
    async def note_for_announcement(app: faust.App, assigned: set, **kwargs: Any) -> None:
        membership.assigned()

    every(app, interval, membership.announce, "announcing the group's assignment")
    return membership
