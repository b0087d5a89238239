"""The Faust classes trajbus adapts: an idempotent producer, a consumer that fetches at
once, rejoins its group on request and stops quietly, and a table keyed by partition;
and the worker's app, configured (``worker_app``).

A retried send must be written once. Faust turns on producer idempotence only with
``processing_guarantee="exactly_once"`` (transactions, which Tansu lacks and which cost
a round trip per commit). Without it, a send whose acknowledgement is lost to a broker
restart is retried and lands twice: a ready group would reach the trainer twice (seen
in the broker-restart test). With idempotence the broker drops the retry by its
producer id and sequence number.

A group that lost a topic must get it back: ``EagerFetchConsumer.rejoin_for`` (the assignment
watch, ``streams.worker.assignment_watch``) refreshes the consumer's metadata and rejoins the group.

A record must reach the worker at once. Faust creates its aiokafka consumer with
``fetch_max_wait_ms=1500``, and aiokafka keeps one fetch in flight per broker: a
fetch for partitions with nothing new holds back the partitions whose records
arrive meanwhile by up to 1.5 s (a 768-step burst of 12-turn steps stalled 1.2 s
in the middle). The worker's consumer waits at most ``FETCH_MAX_WAIT_MS``.

A consumer stopped while Kafka is away must stop without a traceback. Closing, aiokafka
0.14's fetcher cancels its pending fetch tasks and awaits each; one sleeping its retry
backoff after a failed fetch raises that ``CancelledError`` out of ``close()``, which ended
Faust's consumer thread with a traceback on stderr (after the worker gave up on an outage)
and left the consumer's client open. ``EagerFetchConsumerThread.on_thread_stop`` closes it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Mapping

import faust
from aiokafka.errors import UnknownError, UnsupportedVersionError
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import ConsumerT, ProducerT

from trajbus.infra.client_roles import ROLE_DEFAULTS
from trajbus.infra.kafka_config import faust_credentials
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.state_store import partition_of

log = logging.getLogger("trajbus.worker")
FAUST_LOG = logging.getLogger("faust.trajbus")
"""Where these classes' Faust lifecycle lines go: under Faust's log level, not trajbus's."""
FETCH_MAX_WAIT_MS = 50


class IdempotentProducer(faust_aiokafka.Producer):
    """Faust's aiokafka producer with ``enable_idempotence`` (which needs ``acks=all``), where the
    broker grants producer ids; Tansu 0.6 answers aiokafka's request with an unknown error."""

    idempotent = True
    logger = FAUST_LOG

    def _settings_extra(self) -> Mapping[str, Any]:
        extra = super()._settings_extra()
        acked = ROLE_DEFAULTS["acked_producer"]  # the same guarantees as every other producer of trajbus
        return {**extra, "acks": acked["acks"], "enable_idempotence": acked["enable.idempotence"]} \
            if self.idempotent else extra

    async def on_start(self) -> None:
        try:
            await super().on_start()
        except (UnknownError, UnsupportedVersionError) as exc:  # no producer id: not a connection error
            refused, self._producer = self._producer, None
            if refused is not None:
                await refused.stop()
            self.idempotent = False
            log.warning("the broker grants no idempotent producer id (%r): a send retried after a lost "
                        "acknowledgement may write a group twice", exc)
            producer = self._producer = self._new_producer()
            self.beacon.add(producer)
            await producer.start()


class EagerFetchConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """The thread of Faust's consumer, whose aiokafka consumer waits ``FETCH_MAX_WAIT_MS`` for data."""

    logger = FAUST_LOG

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS  # read when the consumer starts its fetcher
        return consumer

    async def on_thread_stop(self) -> None:
        """Faust's stop (method queue, then the aiokafka consumer); a fetch cancelled in its retry backoff
        is no failure of the stop: the rest of it (the client's connections) is done here."""
        try:
            await super().on_thread_stop()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # this stop itself was cancelled
                raise
            log.debug("a fetch cancelled in its retry backoff ended aiokafka's fetcher close; closing its client")
            if self._consumer is not None:
                await self._consumer._client.close()

    async def refresh_and_rejoin(self, topics: frozenset[str]) -> set[str]:
        """In this thread (aiokafka's loop): refresh the consumer's metadata, then, if it knows any of
        ``topics`` now, ask the group coordinator to rejoin; returns the topics it knows.

        A plain rejoin would not do: the leader assigns from the metadata it holds, and aiokafka
        refreshes that only every ``metadata_max_age_ms`` (5 min) while no partition is fetched."""
        consumer = self._ensure_consumer()
        await consumer._client.force_metadata_update()
        known = {topic for topic in topics if consumer._client.cluster.partitions_for_topic(topic)}
        if known:
            consumer._coordinator.request_rejoin()
        return known


class EagerFetchConsumer(faust_aiokafka.Consumer):
    logger = FAUST_LOG

    def _new_consumer_thread(self) -> EagerFetchConsumerThread:
        return EagerFetchConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def rejoin_for(self, topics: frozenset[str]) -> set[str]:
        """Rejoin the group if Kafka knows any of ``topics`` (``refresh_and_rejoin``); returns those."""
        thread = self._thread
        assert isinstance(thread, EagerFetchConsumerThread)
        return await thread.call_thread(thread.refresh_and_rejoin, topics)


class IdempotentApp(faust.App):
    """``faust.App`` whose one producer (tables' changelogs, groups, DLQ) is an ``IdempotentProducer``
    and whose consumer is a ``EagerFetchConsumer``."""

    logger = FAUST_LOG

    def _new_producer(self) -> ProducerT:
        return IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)

    def _new_consumer(self) -> ConsumerT:
        return EagerFetchConsumer(self.transport, callback=self.topics.on_message, loop=self.transport.loop,
                              on_partitions_revoked=self._on_partitions_revoked,
                              on_partitions_assigned=self._on_partitions_assigned, beacon=self.beacon)


class PartitionKeyedTable(faust.Table):
    """A table whose keys name their own changelog partition (the source partition)."""

    logger = FAUST_LOG

    def partition_for_key(self, key: Any) -> int:
        return partition_of(key)


def _broker_urls(bootstrap_servers: str) -> list[str]:
    return [f"kafka://{server.strip()}" for server in bootstrap_servers.split(",") if server.strip()]


def worker_app(bootstrap_servers: str, settings: WorkerSettings, datadir: Path) -> IdempotentApp:
    """The worker's Faust app, configured for ``settings``; ``streams.worker.assembler.build_app`` wires its agent."""
    return IdempotentApp(
        settings.app_id,
        broker=_broker_urls(bootstrap_servers),
        broker_credentials=faust_credentials(),  # the same connection as every other client
        store="memory://",  # tables are rebuilt from their changelog topics on start
        datadir=str(datadir),  # Faust's local files; nothing in them outlives the process
        topic_partitions=settings.topics.steps_partitions,
        # Faust declares no topic: its declaration asks the first broker of its metadata for the
        # controller, which may be a dead node (the worker then exited). The worker provisions
        # every topic, its table's changelog too, with trajbus's admin client (``worker_topics``).
        topic_allow_declare=False,
        topic_disable_leader=True,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        table_standby_replicas=0,
        # Latency over batching: a group should be fetchable milliseconds after its
        # last step, so the producer sends at once and offsets are committed every
        # 100 events or 0.5 s. Correctness does not rest on these commits: the table
        # holds its own source positions, so a longer interval only costs replay.
        producer_linger=0.0,
        stream_wait_empty=False,
        broker_commit_every=100,
        broker_commit_interval=0.5,
        # A dead worker's partitions move to the others after 10 s, not Faust's default 60 s.
        broker_session_timeout=10.0,
        broker_heartbeat_interval=1.0,
        producer_max_request_size=settings.topics.max_message_bytes,
        consumer_max_fetch_size=settings.topics.max_message_bytes,
    )
