"""Acknowledgements of the producer's calls: who waits for which delivery reports, and who serves them.

A call waits on its own delivery reports, which one poll thread per producer serves
while any call is in flight: a thread's call waits on a lock its last report releases,
a coroutine's on a future the report resolves through its event loop, holding no thread.
Before, every caller polled, and a report served by another caller's poll left its own
caller asleep until that poll's 50 ms timeout (at one step per call from 16 threads this
took 2.4k-token steps from 650 to 1,400 acknowledged steps/s; ``benchmarks.agentic_bench``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

from confluent_kafka import KafkaError

log = logging.getLogger(__name__)


def resolve(settled: asyncio.Future) -> None:
    """Settle a coroutine's wait for its call (from the event loop, where ``call_soon_threadsafe`` runs it)."""
    if not settled.done():  # else the waiter gave up (timed out or cancelled)
        settled.set_result(None)


class DeliveryError(RuntimeError):
    """The broker did not acknowledge every record of a call."""


class TopicsUnavailable(DeliveryError):
    """A channel's topics could not be provisioned (the broker is unreachable): nothing was sent."""


class Acks:
    """Delivery reports of one call. They arrive on whichever thread polls the client (the producer's
    poll thread; a caller whose local queue is full; ``close``'s flush); the last one settles the call:
    ``wait`` returns and ``on_settled`` runs (an event loop's wake-up, on the polling thread)."""

    __slots__ = ("expected", "delivered", "errors", "lock", "gate", "on_settled", "release")

    def __init__(self, expected: int, on_settled: Callable[[], None] | None = None) -> None:
        self.expected = expected
        self.delivered = 0
        self.errors: list[KafkaError] = []
        self.lock = threading.Lock()
        self.gate = threading.Lock()  # held until settled: a bare lock is a cheaper wait than an Event
        self.gate.acquire()
        self.on_settled = on_settled
        self.release: Callable[[], None] | None = None
        """Set by the poller: told once, when the call is settled (it counts calls in flight)."""

    def __call__(self, error: KafkaError | None, _message: Any = None) -> None:
        with self.lock:
            if error is None:
                self.delivered += 1
            else:
                self.errors.append(error)
            if self.delivered + len(self.errors) != self.expected:
                return
        self._settle()

    def expect(self, produced: int) -> None:
        """Only ``produced`` records were queued (producing the next one failed): settle on those."""
        with self.lock:
            self.expected = produced
            if self.delivered + len(self.errors) != produced:
                return
        self._settle()

    @property
    def settled(self) -> bool:
        return not self.gate.locked()

    def wait(self, timeout: float) -> bool:
        """Whether the call settled within ``timeout`` seconds."""
        if not self.gate.acquire(timeout=timeout):
            return False
        self.gate.release()
        return True

    def late(self, topic: str, timeout: float) -> DeliveryError:
        """What a call whose records were not all acknowledged within ``timeout`` raises."""
        return DeliveryError(f"{self.expected - self.delivered} of {self.expected} records to {topic} "
                             f"not acknowledged within {timeout}s")

    def raise_errors(self, topic: str) -> None:
        """Raise ``DeliveryError`` if the broker refused any record of the call."""
        if self.errors:
            raise DeliveryError(f"{len(self.errors)} of {self.expected} records to {topic} failed: "
                                f"{self.errors[0].str()}")

    def _settle(self) -> None:
        self.gate.release()
        if self.release is not None:
            self.release()
        if self.on_settled is not None:
            try:
                self.on_settled()
            except RuntimeError:  # the caller's event loop is closed: nobody waits any more
                pass


class Poller:
    """One thread serving the client's delivery reports while any call is in flight, so a caller waits
    on its own call (or an event loop on its future), never in a poll of its own.

    (When every caller polled, a report served by another caller's poll left its own caller asleep
    until that poll's timeout.) The thread starts with the first call and sleeps while none is in
    flight, so an idle producer costs no wake-ups and ``close`` stops it at once."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.in_flight = 0
        self.stopping = False
        self.changed = threading.Condition(threading.Lock())
        self.thread: threading.Thread | None = None

    def track(self, acks: Acks) -> None:
        """Count ``acks`` in flight until it settles (before its first record is queued)."""
        acks.release = self._settled
        with self.changed:
            if self.stopping:
                raise DeliveryError("producer is closed")
            self.in_flight += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name="trajbus-producer-poll", daemon=True)
                self.thread.start()
            elif self.in_flight == 1:
                self.changed.notify()

    def _settled(self) -> None:
        with self.changed:
            self.in_flight -= 1

    def _serve(self) -> None:
        while True:
            with self.changed:
                while not self.in_flight and not self.stopping:
                    self.changed.wait()
                if self.stopping:
                    return
            try:
                self.client.poll(0.05)  # returns as soon as reports were served
            except Exception:  # a callback raised: the call it belongs to still settles or times out
                log.exception("delivery report callback failed")

    def stop(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()


def produce_acked(producer: Any, topic: str, records: list[tuple[bytes | None, bytes | None, list]],
                  timeout: float = 30.0) -> None:
    """Produce ``records`` (key, value, headers) on a producer of the caller's own and return once the broker
    acknowledged every one (``DeliveryError`` otherwise): for the few records of a ledger write, a dead
    letter or a policy version, where a flush is the wait."""
    acks = Acks(len(records))
    for key, value, headers in records:
        producer.produce(topic, key=key, value=value, headers=headers, on_delivery=acks)
    if producer.flush(timeout):
        raise acks.late(topic, timeout)
    acks.raise_errors(topic)
