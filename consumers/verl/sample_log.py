"""verl's samples on one Kafka partition, in the order they were put: verl's FIFO, made durable.

A value is what the rollouter put: the bytes of ``ray.cloudpickle.dumps(RolloutSample)`` as they
are (header ``kind: bytes``), any other object pickled (``kind: pickle``), or the end-of-stream
sentinel ``None`` (a record with no value, ``kind: end``). Samples of 8 responses x 2.5k tokens
weigh megabytes: records are lz4-compressed and may be up to ``MAX_SAMPLE_BYTES``.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, TopicPartition

from trajbus.infra.client_roles import DELIVERY_TIMEOUT_MS
from trajbus.infra.clients import acked_producer, reader
from trajbus.infra.topics import watermarks
from trajbus.streams.client.delivery import Acks, Poller, resolve

log = logging.getLogger(__name__)

MAX_SAMPLE_BYTES = 128 * 1024 * 1024
KIND = "trajbus.verl.kind"
END = object()
"""What ``take`` returns for the end-of-stream record (the sentinel ``None`` the rollouter put)."""


def encode(sample: Any) -> tuple[bytes | None, bytes]:
    """(value, kind) of one ``put_sample`` argument."""
    if sample is None:
        return None, b"end"
    if isinstance(sample, (bytes, bytearray, memoryview)):
        return bytes(sample), b"bytes"
    import ray  # only for a sample that is not already pickled

    return ray.cloudpickle.dumps(sample), b"pickle"


def decode(value: bytes | None, kind: bytes) -> Any:
    if kind == b"end":
        return None
    return pickle.loads(value) if kind == b"pickle" else value


class SampleLog:
    """Appends acknowledged samples and reads them from a position of its own (partition 0)."""

    def __init__(self, bootstrap_servers: str, topic: str, timeout: float = DELIVERY_TIMEOUT_MS / 1000) -> None:
        self.topic = topic
        self.timeout = timeout
        self._partition = TopicPartition(topic, 0)
        self._producer = acked_producer(bootstrap_servers, {
            "logger": log, "compression.type": "lz4", "linger.ms": 1, "message.max.bytes": MAX_SAMPLE_BYTES})
        self._poller = Poller(self._producer)
        self._reader = reader(bootstrap_servers, {
            "logger": log, "fetch.max.bytes": MAX_SAMPLE_BYTES, "max.partition.fetch.bytes": 16 * 1024 * 1024,
            "fetch.wait.max.ms": 100, "queued.max.messages.kbytes": 256 * 1024})
        self._probe = reader(bootstrap_servers, {"logger": log})
        """Offset look-ups of its own: the reader's would wait behind its pending fetch (~100 ms)."""
        self.position = 0
        """The offset of the next record to hand out."""
        self._acked_end = 0
        """The offset after this log's own newest acknowledged sample."""

    # -- writing -----------------------------------------------------------------------
    async def append(self, sample: Any) -> None:
        """Returns once the broker acknowledged the sample (``DeliveryError`` otherwise)."""
        value, kind = encode(sample)
        loop = asyncio.get_running_loop()
        settled = loop.create_future()
        acks = Acks(1, partial(loop.call_soon_threadsafe, resolve, settled))
        self._poller.track(acks)
        try:
            self._producer.produce(self.topic, value=value, headers=[(KIND, kind)],
                                   on_delivery=partial(self._delivered, acks))
        except BaseException:
            acks.expect(0)
            raise
        try:
            await asyncio.wait_for(settled, self.timeout)
        except asyncio.TimeoutError:
            raise acks.late(self.topic, self.timeout) from None
        acks.raise_errors(self.topic)

    def _delivered(self, acks: Acks, error: KafkaError | None, message: Any) -> None:
        if error is None:
            self._acked_end = max(self._acked_end, message.offset() + 1)
        acks(error, message)

    # -- reading (a SampleSource: blocking calls, made from the queue's reading thread) -----
    def where(self) -> int:
        return self.position

    def resume(self, where: int) -> None:
        """Read from offset ``where`` on."""
        self.position = where
        self._reader.assign([TopicPartition(self.topic, 0, where)])

    def from_start(self) -> None:
        """A run of the experiment with no checkpoint yet reads every sample the topic holds."""
        self.resume(self.bounds()[0])

    def begin_fresh(self) -> None:
        """A run that ignores checkpoints (``resume_mode: disable``) reads what is put from now on."""
        self.skip_to(self.end())

    def end(self) -> int:
        return self.bounds()[1]

    def skip_to(self, end: int) -> None:
        """Hand out nothing before ``end`` (``clear_queue``)."""
        self.resume(max(end, self.position))

    def version_ended(self, version: int) -> None:
        """Nothing to do: the position is recorded by the queue."""

    def take(self, timeout: float) -> Any:
        """The next sample (``END`` for the sentinel), or ``None`` if none arrives in ``timeout`` seconds.
        Blocking: call it from a thread."""
        message = self._reader.poll(timeout)
        while message is not None and message.error() is not None:
            if message.error().code() != KafkaError._PARTITION_EOF:
                log.warning("reading %s: %s", self.topic, message.error().str())
            message = self._reader.poll(0)
        if message is None:
            return None
        self.position = message.offset() + 1
        headers = dict(message.headers() or [])
        sample = decode(message.value(), headers.get(KIND, b"bytes"))
        return END if sample is None else sample

    def bounds(self) -> tuple[int, int]:
        """The log's start and end offsets, asked of the broker."""
        return watermarks(self._probe, self._partition, 30.0)

    def backlog(self) -> int:
        """Put and not yet handed out, as Kafka last told: the end of this log's own acknowledged puts (in
        verl's layout every put goes through this one queue: exact) or of the reader's last fetch,
        whichever is further. Free of a broker round trip: the trainer asks it with every sample."""
        _low, fetched_end = self._reader.get_watermark_offsets(self._partition, cached=True)
        return max(0, self._acked_end - self.position, fetched_end - self.position)

    def close(self) -> None:
        self._poller.stop()
        self._producer.flush(self.timeout)
        self._reader.close()
        self._probe.close()
