"""The dead-letter queue contract: a record as received, plus why and where from.

Every component that cannot process a record writes it to ``{prefix}.dlq`` with
these headers instead of dropping it, so nothing malformed disappears silently.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from trajbus.streams.delivery import produce_acked
from trajbus.streams.topics import dlq_topic

REASON = "trajbus-dlq-reason"
SOURCE_TOPIC = "trajbus-dlq-source-topic"
SOURCE_PARTITION = "trajbus-dlq-source-partition"
SOURCE_OFFSET = "trajbus-dlq-source-offset"
AT = "trajbus-dlq-at"


def dlq_headers(original: list[tuple[str, bytes]] | dict | None, reason: str, topic: str, partition: int,
                offset: int) -> list[tuple[str, bytes]]:
    """The original headers followed by the DLQ headers."""
    if isinstance(original, dict):
        headers = list(original.items())
    else:
        headers = list(original or [])
    return headers + [
        (REASON, reason.encode()),
        (SOURCE_TOPIC, topic.encode()),
        (SOURCE_PARTITION, str(partition).encode()),
        (SOURCE_OFFSET, str(offset).encode()),
        (AT, f"{time.time():.3f}".encode()),
    ]


def dead_letter(producer: Any, prefix: str, message: Any, reason: str, log: logging.Logger,
                timeout: float = 30.0) -> None:
    """Copy a record read with confluent-kafka (``message``) to ``{prefix}.dlq`` with why and where from,
    acknowledged, and say so in a log line."""
    headers = dlq_headers(message.headers(), reason, message.topic(), message.partition(), message.offset())
    produce_acked(producer, dlq_topic(prefix), [(message.key(), message.value(), headers)], timeout)
    log.warning("dlq topic=%s partition=%d offset=%d reason=%s",
                message.topic(), message.partition(), message.offset(), reason)
