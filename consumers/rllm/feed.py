"""The steps topic and the store's own (``consumers.rllm.kept``) read into the rLLM store's ``TraceIndex``,
from their start, by a thread of its own.

The index is a fold of the log and nothing else: the store's own writes reach it the same way as
everyone's, by being read back. A write therefore registers a waiter (``expect``) before it produces
its record, and returns once the feed applied it: what a call stored, the next call reads. The feed
reads with ``assign()`` and never commits, so it disturbs no consumer group, and it reads only the
records an rLLM store wrote (their metadata says so); other steps of the channel are skipped. The two
topics are read side by side: a trajectory's records are ordered within each, and the index's fold
does not depend on how the two interleave (a trace of a deleted trajectory is ignored from either).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, Message, TopicPartition

from trajbus.consumers.rllm.index import TraceIndex
from trajbus.consumers.rllm.kept import KeptTrace, event_value, read_kept
from trajbus.consumers.rllm.traces import DELETED, ENDED, TRACE_KEY, entry_of, event_of
from trajbus.infra.clients import reader
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import PrefixError, PrefixResolver, StepDelta, step_of
from trajbus.streams.wire.records import Step, TrajectoryEnd

__all__ = ["TraceFeed"]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
"""How long one poll waits before the feed looks at its stop flag again."""


def _settle(future: asyncio.Future | None, value: Any) -> None:
    """Resolve a waiter from the feed's thread, on its own event loop (gone: nobody waits any more)."""
    if future is None:
        return

    def resolve() -> None:
        if not future.done():
            future.set_result(value)
    try:
        future.get_loop().call_soon_threadsafe(resolve)
    except RuntimeError:
        pass


class TraceFeed:
    """Applies every rLLM record of ``topic`` and ``kept_topic`` to ``index`` (holding ``lock``), and wakes
    their writers."""

    def __init__(self, bootstrap_servers: str, topic: str, kept_topic: str, index: TraceIndex,
                 lock: threading.Lock) -> None:
        self.topic = topic
        self.kept_topic = kept_topic
        self.index = index
        self.lock = lock
        self.caught_up = threading.Event()
        """Set once every partition was read to the end it had at start: the index holds the topic's past."""
        self._stop = threading.Event()
        self._resolver = PrefixResolver()
        self._waiters: dict[str, asyncio.Future] = {}
        self._behind: set[tuple[str, int]] = set()
        self._consumer = reader(bootstrap_servers, {"enable.partition.eof": True, "fetch.wait.max.ms": 50,
                                                    "logger": log})
        self._thread = threading.Thread(target=self._run, name="trajbus-rllm-feed", daemon=True)

    def start(self, timeout: float) -> None:
        """Assign every partition of both topics (which exist) from its start, and read in the background."""
        for topic in (self.topic, self.kept_topic):
            partitions = self._consumer.list_topics(topic, timeout=timeout).topics[topic].partitions
            if not partitions:
                self._consumer.close()
                raise RuntimeError(f"topic {topic} has no partitions (does it exist?)")
            self._behind.update((topic, partition) for partition in partitions)
        self._consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in sorted(self._behind)])
        self._thread.start()

    def expect(self, record_id: str) -> asyncio.Future:
        """A future the feed resolves when it applies the record ``record_id`` names; call it before producing."""
        future = asyncio.get_running_loop().create_future()
        with self.lock:
            self._waiters[record_id] = future
        return future

    def forget(self, record_id: str) -> None:
        """The record was not produced after all (or its writer gave up waiting)."""
        with self.lock:
            self._waiters.pop(record_id, None)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop reading; the thread closes its consumer."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                message = self._consumer.poll(POLL_SECONDS)
                if message is None:
                    continue
                error = message.error()
                if error is None:
                    self._apply(message)
                elif error.code() == KafkaError._PARTITION_EOF:
                    self._reached_end(message.topic(), message.partition())
                else:
                    log.info("rllm trace feed: client event on %s: %s", self.topic, error.str())
        finally:
            self._consumer.close()

    def _reached_end(self, topic: str, partition: int) -> None:
        if self.caught_up.is_set():
            return
        self._behind.discard((topic, partition))
        if not self._behind:
            with self.lock:
                sessions, traces = self.index.size()
            log.info("rllm trace index caught up topic=%s sessions=%d traces=%d", self.topic, sessions, traces)
            self.caught_up.set()

    def _apply(self, message: Message) -> None:
        try:
            if message.topic() == self.kept_topic:
                self._apply_kept(message)
                return
            try:
                record = codec.decode(message.value())
            except codec.DecodeError as exc:
                log.warning("rllm trace feed skipped %s[%d]@%d: %s", self.topic, message.partition(),
                            message.offset(), exc)
                return
            if isinstance(record, (Step, StepDelta)):
                self._apply_step(record)
            elif isinstance(record, TrajectoryEnd):
                self._apply_event(record)
        except Exception:  # one bad record must not stop the index  # noqa: BLE001
            log.exception("rllm trace feed could not apply %s[%d]@%d", message.topic(), message.partition(),
                          message.offset())

    def _apply_step(self, record: Step | StepDelta) -> None:
        if TRACE_KEY not in step_of(record).metadata:
            return  # a step no rLLM store wrote
        try:
            step = self._resolver.resolve(record)
        except PrefixError as exc:  # its base is past the topic's retention
            log.warning("rllm trace feed skipped a trace: %s", exc)
            return
        entry = entry_of(step)
        if entry is None:
            return
        with self.lock:
            self.index.add(entry)
            waiter = self._waiters.pop(entry.trace_id, None)
        _settle(waiter, None)

    def _apply_event(self, end: TrajectoryEnd) -> None:
        event = event_of(end)
        if event is None:
            return
        session_id, kind, event_id = event
        # a deletion is the abandon event (trajectory_uid "*"); the incarnation is its prompt_uid
        self._fold_event(session_id, kind, end.prompt_uid if kind == DELETED else end.trajectory_uid, event_id)
        if kind == DELETED:
            self._resolver.memory.forget(end.prompt_uid)

    def _apply_kept(self, message: Message) -> None:
        """A record of the store's own topic: a trace that is no step, or an event of a trajectory with none."""
        record = read_kept(message.value())
        if isinstance(record, KeptTrace):
            with self.lock:
                self.index.add(record)
                waiter = self._waiters.pop(record.trace_id, None)
            _settle(waiter, None)
            return
        event = event_value(record) if record is not None else None
        if event is None or event[1] not in (ENDED, DELETED):
            log.warning("rllm trace feed skipped %s[%d]@%d: not a record of an rLLM store", self.kept_topic,
                        message.partition(), message.offset())
            return
        session_id, kind, trajectory_uid, event_id = event
        self._fold_event(session_id, kind, trajectory_uid, event_id)

    def _fold_event(self, session_id: str, kind: str, trajectory_uid: str, event_id: str) -> None:
        """A session event into the index; wakes its writer with the traces it deleted."""
        with self.lock:
            if kind == DELETED:
                result = self.index.delete(session_id, trajectory_uid)
            else:
                self.index.end(trajectory_uid)
                result = 0
            waiter = self._waiters.pop(event_id, None)
        _settle(waiter, result)
