"""What the worker writes to Kafka, each write acknowledged: groups, their chunks, ledger outcomes, dead letters.

Emission and recovery are given an ``Outbox`` (the ``Sends`` Protocol), not Faust topics, so
their rules run in unit tests against a fake that records the writes (``tests/unit/fakes``).
Every method returns only once the broker acknowledged: the table never records what Kafka
may not hold.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Protocol

import faust

from trajbus.streams.client.dlq import DeadLetter
from trajbus.streams.wire import ledger
from trajbus.streams.wire.headers import Headers, content_type_headers
from trajbus.streams.wire.topics import chunks_topic, dlq_topic, groups_topic, prompts_topic
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.stats import WorkerMetrics

log = logging.getLogger("trajbus.worker")

Placed = tuple[int, int]
"""(partition, offset) of an acknowledged record."""


class Sends(Protocol):
    """The worker's acknowledged writes."""

    async def group(self, channel: str, key: bytes, value: bytes, headers: Headers, timestamp: float) -> Placed: ...

    async def chunks(self, channel: str, key: bytes, pieces: Iterable[bytes]) -> list[Placed]: ...

    async def outcome(self, channel: str, outcome: ledger.Outcome) -> None: ...

    async def dead_letter(self, channel: str, letter: DeadLetter) -> None: ...

    def chunks_topic(self, channel: str) -> str: ...


class Outbox:
    """``Sends`` through the Faust app's producer (idempotent: a retried send is written once)."""

    def __init__(self, app: faust.App, settings: WorkerSettings, metrics: WorkerMetrics) -> None:
        prefix = settings.topics.prefix
        self.prefix, self.metrics = prefix, metrics

        def topic(name: str) -> Any:
            return app.topic(name, key_serializer="raw", value_serializer="raw")

        self.groups = {c: topic(groups_topic(c, prefix)) for c in settings.channels}
        self.chunk_topics = {c: topic(chunks_topic(c, prefix)) for c in settings.channels}
        self.ledgers = {c: topic(prompts_topic(c, prefix)) for c in settings.channels}
        self.dlq = topic(dlq_topic(prefix))

    async def group(self, channel: str, key: bytes, value: bytes, headers: Headers, timestamp: float) -> Placed:
        sent = await self.groups[channel].send(key=key, value=value, headers=headers, timestamp=timestamp)
        metadata = await sent  # the broker's acknowledgement
        return metadata.partition, metadata.offset

    async def chunks(self, channel: str, key: bytes, pieces: Iterable[bytes]) -> list[Placed]:
        """All pieces sent at once, then each acknowledgement awaited."""
        sent = [await self.chunk_topics[channel].send(key=key, value=bytes(piece)) for piece in pieces]
        return [(m.partition, m.offset) for m in [await each for each in sent]]

    async def outcome(self, channel: str, outcome: ledger.Outcome) -> None:
        key, value = ledger.encode_record(outcome)
        await (await self.ledgers[channel].send(key=key, value=value,
                                                headers=content_type_headers(ledger.CONTENT_TYPE)))

    async def dead_letter(self, channel: str, letter: DeadLetter) -> None:
        """The worker's one dead-letter writer: the letter, acknowledged, counted and told."""
        await (await self.dlq.send(key=letter.key, value=letter.value, headers=letter.headers))
        self.metrics.dlq.labels(channel, letter.kind).inc()
        letter.tell(log)

    def chunks_topic(self, channel: str) -> str:
        return chunks_topic(channel, self.prefix)
