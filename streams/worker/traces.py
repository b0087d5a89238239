"""The worker's spans (tracing on only, ``infra.tracing``): each step event applied, each group's end.

``trajbus.apply`` is one event applied; its parent is the record's ``traceparent`` (the gateway's
publish span), else the trajectory's root. The context of the last event applied per trajectory is
kept in memory (bounded: the oldest go first; a worker that restarts parents to the root instead)
until its group ends: ``trajbus.emit``, one span per trajectory of the group, is that context's child.
An emitted group's record names each trajectory's emit span in its ``trajbus-traceparents`` header,
so the trainer's fetch continues the trace.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

from cachetools import LRUCache
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from trajbus.infra import tracing
from trajbus.streams.wire.headers import encode_traceparents

REMEMBERED = 100_000
"""Trajectories whose last applied context is kept (about 200 bytes each)."""


class StepTraces:
    """Apply and emit spans, and the last applied context of each pending trajectory."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self._last: LRUCache[str, Context] = LRUCache(remembered)
        self._emitting: dict[tuple[str, str], dict[str, trace.Span]] = {}

    @contextlib.contextmanager
    def applying(self, channel: str, partition: int, message: Any, event: Any) -> Iterator[trace.Span]:
        """The span of applying ``event`` (read as ``message``); remembered as its trajectory's last."""
        uid = event.trajectory_uid
        parent = tracing.parent_context(uid, tracing.context_from_headers(message.headers))
        attributes = {tracing.TRAJECTORY_UID: uid, tracing.PROMPT_UID: event.prompt_uid, tracing.CHANNEL: channel,
                      tracing.PARTITION: partition, tracing.OFFSET: message.offset}
        step_index = getattr(event, "step_index", None)
        if step_index is not None:
            attributes[tracing.STEP_INDEX] = step_index
        span = tracing.tracer().start_span(tracing.APPLY, context=parent, kind=SpanKind.CONSUMER,
                                           attributes=attributes)
        self._last[uid] = trace.set_span_in_context(span)  # before the body: it may emit the group
        with trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
            yield span

    def start_emit(self, channel: str, prompt_uid: str, uids: Iterable[str]) -> bytes:
        """Emit spans of a group about to be written, one per trajectory; returns the group record's
        ``trajbus-traceparents`` header value naming them."""
        spans = {uid: self._emit_span(channel, prompt_uid, uid) for uid in uids}
        self._emitting[(channel, prompt_uid)] = spans
        return encode_traceparents({uid: tracing.traceparent(trace.set_span_in_context(span))
                                    for uid, span in spans.items()})

    def end_emit(self, channel: str, prompt_uid: str, uids: Iterable[str], outcome: str,
                 placed: tuple[int, int] | None = None) -> None:
        """The group's outcome: its emit spans (started by ``start_emit``, else made now) end with it, and its
        trajectories' contexts are forgotten."""
        spans = self._emitting.pop((channel, prompt_uid), None)
        if spans is None:
            spans = {uid: self._emit_span(channel, prompt_uid, uid) for uid in uids}
        for uid, span in spans.items():
            span.set_attribute(tracing.OUTCOME, outcome)
            if placed is not None:
                span.set_attributes({tracing.PARTITION: placed[0], tracing.OFFSET: placed[1]})
            span.end()
            self._last.pop(uid, None)

    def _emit_span(self, channel: str, prompt_uid: str, uid: str) -> trace.Span:
        parent = tracing.parent_context(uid, self._last.get(uid))
        return tracing.tracer().start_span(tracing.EMIT, context=parent, kind=SpanKind.PRODUCER, attributes={
            tracing.TRAJECTORY_UID: uid, tracing.PROMPT_UID: prompt_uid, tracing.CHANNEL: channel})


def step_traces() -> StepTraces | None:
    """The worker's spans when tracing is on, else None (one check per event)."""
    return StepTraces() if tracing.enabled() else None
