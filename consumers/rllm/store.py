"""rLLM's trace store on Kafka: ``rllm_model_gateway``'s ``TraceStore`` protocol over a trajbus steps topic.

rLLM's model gateway (``pip install rllm-model-gateway``) keeps each LLM call's trace (prompt ids,
completion ids, log-probs, weight version) through a ``TraceStore`` and ships a memory and a SQLite
one. This one writes each trace as a trajbus ``Step`` on ``{prefix}.steps.{channel}``, so the traces
are durable (acknowledged by every in-sync replica), replayable (``trajbus replay``, ``trajbus
tail``) and readable by trajbus's worker and consumers, and it answers rLLM's trainer from that
topic. A user starts rLLM's gateway with it, the agents unchanged::

    import uvicorn
    from rllm_model_gateway import GatewayConfig, WorkerConfig, create_app
    from trajbus.consumers.rllm import KafkaTraceStore

    store = KafkaTraceStore(bootstrap_servers="localhost:9092", channel="rllm")
    app = create_app(GatewayConfig(workers=[WorkerConfig(url="http://localhost:8000/v1")], sync_traces=True),
                     store=store)
    uvicorn.run(app, host="0.0.0.0", port=9090)

(``sync_traces=True``: rLLM stores a trace before answering its call; otherwise background tasks store
traces in no set order, and a session's steps could reach the trainer out of order.)
(rLLM's ``rllm-model-gateway`` command and its trainer's ``GatewayManager`` only know ``--store
memory|sqlite``: the store is given through ``create_app``.) rLLM's gateway closes the store when it
stops.

How it answers: an in-memory index (``consumers.rllm.index``) is the topic folded from its start, by
a reader thread (``consumers.rllm.feed``): a new store, after a restart, rebuilds it before its first
answer, and then each trace costs its own read once; a session's traces are kept sorted by store
time. Every write returns once the broker acknowledged it *and* the index read it back, so a call
reads what an earlier call stored, and ``flush`` has nothing to do.

Where it differs from rLLM's stores, on purpose:

- a trace that can be a training step (token ids as lists, ``completion_token_ids`` non-empty,
  ``logprobs`` None or one per completion token, ``weight_version`` None or an integer) is a Step, and
  its log-probs come back as float32, as the engine reported them;
- a ``trace_id`` is written once: storing the same trace again is a no-op, other data under it is
  refused (a log is not rewritten);
- ``delete_session`` appends a tombstone, the log keeps the traces (retention removes them): the
  store forgets the session's traces at the tombstone, and its next trace starts a new trajectory.
  The tombstone is trajbus's *abandon* event for that trajectory's group, so the worker drops the
  group unless it was already emitted, as the prompt ledger's abandon does;
- ``end_session`` (not in rLLM's protocol) ends the session's trajectory with an optional reward:
  only then does trajbus's worker emit it, as a prompt group of one, for ``BatchConsumer``.

Every other trace is kept as rLLM's stores keep it, and returned as given (``consumers.rllm.kept``): a
passthrough call's, an engine's that returned no ids, one whose log-probs do not match its tokens. It
is stored on ``{prefix}.rllm.{channel}``, a topic of the store's own that no worker reads, and served by
``get_trace`` / ``get_session_traces`` / ``list_sessions`` / ``delete_session`` like any other. The
trainer never sees it: it is no Step and takes no step index, so the session's trajectory is its steps
alone, and the next step after it starts a new segment when its prompt does not extend the step before
(as the gateway marks an edited history); ``end_session`` of a trajectory without a step ends it on the
store's topic (the worker sees nothing) and returns 0. Each such trace is counted in the
``trajbus_rllm_untrainable_traces{channel,key}`` metric and ``untrainable`` (by the trace key at fault),
the first of each key logged as a warning. A trace JSON cannot give back as it is (a tuple, NaN)
is refused, with a ``ValueError``.

One store writes a given session at a time (rLLM's gateway is one process); many may read.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException

from trajbus.consumers.rllm.feed import TraceFeed
from trajbus.consumers.rllm.index import Trace, TraceIndex
from trajbus.consumers.rllm.kept import UNTRAINABLE, KeptTrace, kept_event, kept_spec, kept_topic, kept_trace
from trajbus.consumers.rllm.traces import (DELETED, ENDED, check_ids, entry_of, event_metadata, lineage,
                                           new_incarnation, trace_step)
from trajbus.infra.clients import acked_producer
from trajbus.infra.kafka_config import error_words
from trajbus.infra.topics import ensure_topics
from trajbus.streams.client.delivery import TopicsUnavailable, produce_acked
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.ledger import ABANDON_TRAJECTORY
from trajbus.streams.wire.topics import DEFAULT_PREFIX, steps_topic, validate_channel

__all__ = ["KafkaTraceStore"]

log = logging.getLogger(__name__)


@dataclass
class _Cursor:
    """Where a session's next trace goes: its incarnation, at which step index."""

    trajectory_uid: str
    next_index: int


def _check_window(since: object, limit: object) -> None:
    if since is not None and (isinstance(since, bool) or not isinstance(since, (int, float))):
        raise ValueError(f"since: must be Unix seconds or None, got {since!r}")
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"limit: must be a non-negative integer or None, got {limit!r}")


class KafkaTraceStore:
    """``rllm_model_gateway.store.base.TraceStore`` on ``{prefix}.steps.{channel}`` (module docstring).

    Constructing provisions the channel's topics (idempotent) and starts rebuilding the index; a
    wrong address is one ``TopicsUnavailable`` error within ``timeout`` (10 s at most). ``timeout``
    also bounds each write's acknowledgement and read-back, and the first call's wait for the rebuild.
    """

    def __init__(self, bootstrap_servers: str | None = None, channel: str = "train", prefix: str = DEFAULT_PREFIX,
                 timeout: float = 30.0) -> None:
        self.channel = validate_channel(channel)
        self.timeout = timeout
        self._producer = StepProducer(bootstrap_servers, prefix=prefix, timeout=timeout)
        self.topic = steps_topic(self.channel, self._producer.prefix)
        self.kept_topic = kept_topic(self.channel, self._producer.prefix)
        """Where the traces that are no training step go (module docstring)."""
        self.untrainable: collections.Counter[str] = collections.Counter()
        """Traces this store kept off the training stream, by the trace key at fault."""
        self._kept_producer = acked_producer(self._producer.bootstrap_servers, {"logger": log, "linger.ms": 0})
        self._lock = threading.Lock()
        """Guards the index (written by the feed's thread) and the cursors; never held across an await."""
        self._index = TraceIndex()
        self._cursors: dict[str, _Cursor] = {}
        self._closed = False
        try:
            self._producer.provision(self.channel)
            self._provision_kept()
            self._feed = TraceFeed(self._producer.bootstrap_servers, self.topic, self.kept_topic, self._index,
                                   self._lock)
            self._feed.start(timeout)
        except BaseException:
            self._producer.close()
            raise

    # -- rLLM's TraceStore ------------------------------------------------------------
    async def store_trace(self, trace_id: str, session_id: str, data: dict[str, Any]) -> None:
        """Write the trace as the next Step of the session's trajectory, or on the store's topic when it can be
        no step; returns once it is acknowledged and read back. The same trace again is a no-op; other data
        under a stored ``trace_id`` is refused."""
        await self._ready()
        check_ids(trace_id, session_id)
        if not isinstance(data, dict):
            raise ValueError(f"data: a trace is a dict, got {type(data).__name__}")
        with self._lock:
            stored = self._index.get(trace_id)
            if stored is not None:
                self._check_same(stored, trace_id, session_id, data)
                return
            cursor = self._cursor(session_id)
            try:
                step = trace_step(trace_id, session_id, data, cursor.trajectory_uid, cursor.next_index)
            except ValueError as exc:  # no training step: kept as given (or refused when JSON cannot)
                step = None
                kept, value = kept_trace(trace_id, session_id, data, cursor.trajectory_uid, cursor.next_index,
                                         str(exc))
            else:
                step.metadata.update(lineage(self._index.last(cursor.trajectory_uid), step.step_index,
                                             step.prompt_ids))
                cursor.next_index += 1
        if step is None:
            await self._store_kept(kept, value)
            return
        waiter = self._feed.expect(trace_id)
        try:
            await self._producer.submit_steps_async([step], channel=self.channel)
        except BaseException:
            self._feed.forget(trace_id)
            raise
        await self._read_back(waiter, trace_id, f"trace {trace_id}")

    async def get_trace(self, trace_id: str) -> dict[str, Any] | None:
        """The trace stored under ``trace_id``; None when there is none (or its session was deleted)."""
        await self._ready()
        with self._lock:
            entry = self._index.get(trace_id)
        return entry.data() if entry is not None else None

    async def get_session_traces(self, session_id: str, since: float | None = None,
                                 limit: int | None = None) -> list[dict[str, Any]]:
        """The session's traces stored at or after ``since``, in store-time order, the first ``limit``."""
        _check_window(since, limit)
        await self._ready()
        with self._lock:
            entries = self._index.session_traces(session_id, since, limit)
        return [entry.data() for entry in entries]

    async def delete_session(self, session_id: str) -> int:
        """Append the session's tombstone (one per trajectory it has); returns how many traces it removed."""
        await self._ready()
        with self._lock:
            self._cursors.pop(session_id, None)
            incarnations = self._index.incarnations(session_id)
            plan = [(trajectory_uid, self._index.steps(trajectory_uid)) for trajectory_uid in incarnations]
        deleted = 0
        for trajectory_uid, steps in plan:
            deleted += await self._event(session_id, DELETED, trajectory_uid, steps)
        return deleted

    async def list_sessions(self, since: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Sessions with ``trace_count``, ``first_trace_at``, ``last_trace_at`` (traces stored at or after
        ``since`` count, as in rLLM's SQLite store), the newest session first, the first ``limit``."""
        _check_window(since, limit)
        await self._ready()
        with self._lock:
            return self._index.sessions(since, limit)

    async def flush(self) -> None:
        """Nothing is buffered: every write returned once acknowledged and read back."""
        await self._ready()

    async def close(self) -> None:
        """Stop the reader and the producer (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._shutdown)

    # -- beyond the protocol --------------------------------------------------------
    async def end_session(self, session_id: str, reward: float | None = None) -> int:
        """End the session's trajectory (``reward`` on its last step): trajbus's worker then emits it as a
        group of one. Its next trace starts a new trajectory. Returns the trajectory's step count (0: none of
        its traces could be a step; the worker sees nothing of it)."""
        await self._ready()
        with self._lock:
            self._cursors.pop(session_id, None)
            trajectory_uid = self._index.open_incarnation(session_id)
            steps = self._index.steps(trajectory_uid) if trajectory_uid else []
        if trajectory_uid is None:
            raise ValueError(f"session_id: {session_id!r} has no open trajectory to end (no trace since its "
                             f"last end or deletion)")
        await self._event(session_id, ENDED, trajectory_uid, steps, reward)
        if not steps:
            log.info("rllm session %s ended with no training step (its traces are on %s): nothing for the trainer",
                     session_id, self.kept_topic)
        return len(steps)

    # -- parts ------------------------------------------------------------------------
    async def _ready(self) -> None:
        """Open, and the index rebuilt from the topic's past."""
        if self._closed:
            raise RuntimeError("the trace store is closed")
        if not self._feed.caught_up.is_set() and \
                not await asyncio.to_thread(self._feed.caught_up.wait, self.timeout):
            raise TimeoutError(f"the trace index did not read {self.topic} to its end within {self.timeout:g} s "
                               f"(a larger timeout gives a long topic more time)")

    def _cursor(self, session_id: str) -> _Cursor:
        """The session's cursor: its open trajectory continued (after a restart too), else a new one."""
        cursor = self._cursors.get(session_id)
        if cursor is None:
            trajectory_uid = self._index.open_incarnation(session_id)
            last = self._index.last(trajectory_uid) if trajectory_uid else None
            cursor = _Cursor(trajectory_uid or new_incarnation(session_id), last.step_index + 1 if last else 0)
            self._cursors[session_id] = cursor
        return cursor

    def _provision_kept(self) -> None:
        """Create the store's own topic if missing (idempotent), as the producer provisions the channel's."""
        try:
            ensure_topics(self._producer.bootstrap_servers, [kept_spec(self._producer.settings, self.channel)],
                          self.timeout)
        except (KafkaException, RuntimeError) as exc:
            raise TopicsUnavailable(f"topic {self.kept_topic} not provisioned: {error_words(exc)}") from exc

    @staticmethod
    def _check_same(stored: Trace, trace_id: str, session_id: str, data: dict[str, Any]) -> None:
        """Storing a trace again is fine when it is the same trace (a retry); a log is not rewritten."""
        if isinstance(stored, KeptTrace):
            same = stored.data() == data
        else:
            try:
                again = entry_of(trace_step(trace_id, session_id, data, stored.trajectory_uid, stored.step_index,
                                            stored.created_at))
            except ValueError:  # no step now: other data
                again = None
            same = again is not None and again.data() == stored.data()
        if stored.session_id != session_id or not same:
            raise ValueError(f"trace_id: {trace_id!r} is stored already (session {stored.session_id!r}) with "
                             f"other data; a trace on the log is written once")

    async def _store_kept(self, kept: KeptTrace, value: bytes) -> None:
        """Write a trace that is no step to the store's topic; counted once stored (the first of its key
        logged as a warning, the rest at debug: the metric counts them)."""
        waiter = self._feed.expect(kept.trace_id)
        try:
            await self._produce_kept(kept.trajectory_uid, value)
        except BaseException:
            self._feed.forget(kept.trace_id)
            raise
        await self._read_back(waiter, kept.trace_id, f"trace {kept.trace_id}")
        UNTRAINABLE.labels(self.channel, kept.key).inc()
        self.untrainable[kept.key] += 1
        first = self.untrainable[kept.key] == 1
        log.log(logging.WARNING if first else logging.DEBUG,
                "rllm trace %s of session %s is no training step, kept on %s and never sent to the worker: %s%s",
                kept.trace_id, kept.session_id, self.kept_topic, kept.reason,
                " (the first with this key: trajbus_rllm_untrainable_traces counts them)" if first else "")

    async def _produce_kept(self, trajectory_uid: str, value: bytes) -> None:
        await asyncio.to_thread(produce_acked, self._kept_producer, self.kept_topic,
                                [(trajectory_uid.encode(), value, [])], self.timeout)

    async def _event(self, session_id: str, kind: str, trajectory_uid: str, steps: list[int],
                     reward: float | None = None) -> int:
        """Write a session event of the trajectory; returns what the index did with it (traces deleted).
        A trajectory with steps gets a ``TrajectoryEnd`` (a deletion is the worker's abandon event), one
        without gets a record on the store's topic: the worker never sees a trajectory it has no step of."""
        event_id = uuid.uuid4().hex
        waiter = self._feed.expect(event_id)
        try:
            if not steps:
                await self._produce_kept(trajectory_uid, kept_event(session_id, kind, trajectory_uid, event_id))
            else:
                await self._producer.complete_trajectory_async(
                    ABANDON_TRAJECTORY if kind == DELETED else trajectory_uid, trajectory_uid, reward=reward,
                    channel=self.channel, n_rollouts=1, metadata=event_metadata(session_id, kind, event_id),
                    steps=steps if kind == ENDED else None)
        except BaseException:
            self._feed.forget(event_id)
            raise
        return await self._read_back(waiter, event_id, f"the {kind} event of session {session_id!r}")

    async def _read_back(self, waiter: asyncio.Future, record_id: str, what: str) -> Any:
        try:
            return await asyncio.wait_for(waiter, self.timeout)
        except asyncio.TimeoutError:
            self._feed.forget(record_id)
            raise TimeoutError(f"{what} was acknowledged by the broker but not read back from {self.topic} within "
                               f"{self.timeout:g} s") from None

    def _shutdown(self) -> None:
        self._feed.stop()
        self._producer.close()
        self._kept_producer.flush(self.timeout)
