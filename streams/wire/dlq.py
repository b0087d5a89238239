"""The dead-letter record: a record as received, plus why and where from, in headers.

Every component that cannot process a record copies it to ``{prefix}.dlq`` with its key, value and
headers as received and these headers after them, so nothing malformed disappears silently
(``streams.client.dlq`` builds and writes the letter).
"""

from __future__ import annotations

import time

from trajbus.streams.wire.headers import Headers

REASON = "trajbus-dlq-reason"
SOURCE_TOPIC = "trajbus-dlq-source-topic"
SOURCE_PARTITION = "trajbus-dlq-source-partition"
SOURCE_OFFSET = "trajbus-dlq-source-offset"
AT = "trajbus-dlq-at"


def dlq_headers(original: Headers | dict | None, reason: str, topic: str, partition: int, offset: int) -> Headers:
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
