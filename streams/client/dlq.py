"""Dead letters: a record as received, plus why and where from (its headers: ``streams.wire.dlq``).

Every component that cannot process a record writes it to ``{prefix}.dlq``
instead of dropping it, so nothing malformed disappears silently. A letter is
built and told in one place (``DeadLetter``); clients that read with
confluent-kafka write it with ``dead_letter``, the worker through its outbox
(``streams.worker.outbox.Outbox.dead_letter``): the same record and log line either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from trajbus.streams.client.delivery import produce_acked
from trajbus.streams.wire.dlq import dlq_headers
from trajbus.streams.wire.headers import Headers
from trajbus.streams.wire.topics import dlq_topic


@dataclass(frozen=True)
class DeadLetter:
    """One record for ``{prefix}.dlq``: its key and value as received (a value may be left out, as for a
    group too large to carry), why, and where it came from."""

    key: bytes | None
    value: bytes | None
    reason: str
    topic: str
    partition: int
    offset: int
    original_headers: Headers | dict | None = None

    @property
    def headers(self) -> Headers:
        return dlq_headers(self.original_headers, self.reason, self.topic, self.partition, self.offset)

    @property
    def kind(self) -> str:
        """The reason's first word (``undecodable: ...`` -> ``undecodable``): a metric label."""
        return self.reason.split(":", 1)[0]

    def tell(self, log: logging.Logger) -> None:
        log.warning("dlq topic=%s partition=%d offset=%d reason=%s", self.topic, self.partition, self.offset,
                    self.reason)


def letter_of(message: Any, reason: str) -> DeadLetter:
    """The letter of a record read with confluent-kafka (``message``)."""
    return DeadLetter(message.key(), message.value(), reason, message.topic(), message.partition(), message.offset(),
                      message.headers())


def dead_letter(producer: Any, prefix: str, message: Any, reason: str, log: logging.Logger,
                timeout: float = 30.0) -> None:
    """Copy a record read with confluent-kafka (``message``) to ``{prefix}.dlq`` with why and where from,
    acknowledged, and say so in a log line."""
    letter = letter_of(message, reason)
    produce_acked(producer, dlq_topic(prefix), [(letter.key, letter.value, letter.headers)], timeout)
    letter.tell(log)
