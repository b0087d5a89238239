"""How one producer call's records reach the broker: encoded, queued in order, acknowledged.

``StepProducer`` checks a call's records and picks their topic; this part sends them. Encoding
and queueing happen under one lock, so a step written as a reference to an earlier step of its
trajectory (``streams.wire.prefix``) is always queued after that base. A call that is not
acknowledged, or is cancelled, forgets its trajectories' bases: the broker may not have them,
so their next steps are written whole. With tracing on, each record carries the current span's
W3C ``traceparent`` header (``infra.tracing``).
"""

from __future__ import annotations

import asyncio
import threading
from functools import partial
from typing import Any, Callable

from trajbus.infra import tracing
from trajbus.streams.client.delivery import Acks, Poller, resolve
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import PrefixEncoder
from trajbus.streams.wire.records import Step, TrajectoryEnd

Record = Step | TrajectoryEnd


class RecordSender:
    """Sends a call's records on ``client`` (an acked producer) and waits for their acknowledgements;
    ``prefixes`` is shared with the producer, which checks new steps against what was sent."""

    def __init__(self, client: Any, poller: Poller, prefixes: PrefixEncoder) -> None:
        self._client = client
        self._poller = poller
        self._prefixes = prefixes
        self._order_lock = threading.Lock()

    def publish(self, topic: str, records: list[Record], timeout: float) -> int:
        """Send and wait on a lock; returns how many records the broker acknowledged."""
        acks = self._send(topic, records)
        try:
            if not acks.wait(timeout):
                raise acks.late(topic, timeout)
            acks.raise_errors(topic)
        except BaseException:
            self._forget(records)
            raise
        return acks.delivered

    async def publish_async(self, topic: str, records: list[Record], timeout: float) -> int:
        """``publish`` for an event loop: waits on a future the last delivery report resolves."""
        loop = asyncio.get_running_loop()
        settled = loop.create_future()
        acks = self._send(topic, records, partial(loop.call_soon_threadsafe, resolve, settled))
        try:
            try:
                await asyncio.wait_for(settled, timeout)
            except asyncio.TimeoutError:
                raise acks.late(topic, timeout) from None
            acks.raise_errors(topic)
        except BaseException:  # DeliveryError, or the caller cancelled before the acknowledgement
            self._forget(records)
            raise
        return acks.delivered

    def _send(self, topic: str, records: list[Record], on_settled: Callable[[], None] | None = None) -> Acks:
        """Encode and queue every record; the returned acks settle once the broker answered for each."""
        acks = Acks(len(records), on_settled)
        self._poller.track(acks)
        produced = 0
        try:
            with self._order_lock:  # encoded and queued together: a step is queued after the base it names
                for record in records:
                    self._produce(topic, record, self._encode(record), acks)
                    produced += 1
        except BaseException:
            acks.expect(produced)
            self._forget(records)
            raise
        return acks

    def _forget(self, records: list[Record]) -> None:
        with self._order_lock:  # a step may not have reached the broker: none is a base any more
            for record in records:
                self._prefixes.forget(record.trajectory_uid)

    def _encode(self, record: Record) -> bytes:
        if isinstance(record, Step):
            return codec.encode(self._prefixes.delta(record))
        self._prefixes.forget(record.trajectory_uid)
        return codec.encode(record)

    def _produce(self, topic: str, record: Record, payload: bytes, acks: Acks) -> None:
        headers = codec.headers_for(record)
        if tracing.enabled():  # the current span (the gateway's publish) goes with the record
            tracing.inject_headers(headers)
        while True:
            try:
                # The record's timestamp is the event's creation time, so a replay by
                # time window selects the events created in it, whenever they were sent.
                self._client.produce(topic, key=record.prompt_uid.encode(), value=payload,
                                     headers=headers, on_delivery=acks,
                                     timestamp=int(record.created_at * 1000))
                return
            except BufferError:  # local queue full: serve delivery reports, then retry
                self._client.poll(0.05)
