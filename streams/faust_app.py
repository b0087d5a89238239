"""The Faust classes trajbus adapts: an idempotent producer, a consumer that fetches at
once and rejoins its group on request, and a table keyed by partition.

A retried send must be written once. Faust turns on producer idempotence only with
``processing_guarantee="exactly_once"`` (transactions, which Tansu lacks and which cost
a round trip per commit). Without it, a send whose acknowledgement is lost to a broker
restart is retried and lands twice: a ready group would reach the trainer twice (seen
in the broker-restart test). With idempotence the broker drops the retry by its
producer id and sequence number.

A group that lost a topic must get it back: ``EagerFetchConsumer.rejoin_for`` (the assignment
watch, ``streams.assignment_watch``) refreshes the consumer's metadata and rejoins the group.

A record must reach the worker at once. Faust creates its aiokafka consumer with
``fetch_max_wait_ms=1500``, and aiokafka keeps one fetch in flight per broker: a
fetch for partitions with nothing new holds back the partitions whose records
arrive meanwhile by up to 1.5 s (a 768-step burst of 12-turn steps stalled 1.2 s
in the middle). The worker's consumer waits at most ``FETCH_MAX_WAIT_MS``.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import faust
from aiokafka.errors import UnknownError, UnsupportedVersionError
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import ConsumerT, ProducerT

from trajbus.infra.clients import ROLE_DEFAULTS

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
        return int(key.split(b"|", 1)[0])
