"""The Faust classes trajbus adapts: an idempotent producer, and a table keyed by partition.

A retried send must be written once. Faust turns on producer idempotence only with
``processing_guarantee="exactly_once"`` (transactions, which Tansu lacks and which cost
a round trip per commit). Without it, a send whose acknowledgement is lost to a broker
restart is retried and lands twice: a ready group would reach the trainer twice (seen
in the broker-restart test). With idempotence the broker drops the retry by its
producer id and sequence number.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import faust
from aiokafka.errors import UnknownError, UnsupportedVersionError
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import ProducerT

log = logging.getLogger("trajbus.worker")
FAUST_LOG = logging.getLogger("faust.trajbus")
"""Where these classes' Faust lifecycle lines go: under Faust's log level, not trajbus's."""


class IdempotentProducer(faust_aiokafka.Producer):
    """Faust's aiokafka producer with ``enable_idempotence`` (which needs ``acks=all``), where the
    broker grants producer ids; Tansu 0.6 answers aiokafka's request with an unknown error."""

    idempotent = True
    logger = FAUST_LOG

    def _settings_extra(self) -> Mapping[str, Any]:
        extra = super()._settings_extra()
        return {**extra, "acks": "all", "enable_idempotence": True} if self.idempotent else extra

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


class IdempotentApp(faust.App):
    """``faust.App`` whose one producer (tables' changelogs, groups, DLQ) is an ``IdempotentProducer``."""

    logger = FAUST_LOG

    def _new_producer(self) -> ProducerT:
        return IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)


class PartitionKeyedTable(faust.Table):
    """A table whose keys name their own changelog partition (the source partition)."""

    logger = FAUST_LOG

    def partition_for_key(self, key: Any) -> int:
        return int(key.split(b"|", 1)[0])
