"""The trainer's spans (tracing on only, ``infra.tracing``): each group fetched, each batch converted.

``trajbus.fetch`` is one per trajectory of a group handed out: its parent is the worker's emit span
of that trajectory, named in the group record's ``trajbus-traceparents`` header (else the trajectory's
root); it lasts from the trainer's ask to the group's arrival, so a trainer waiting on groups shows.
``trajbus.convert`` (rows to tensors) is a child of the batch's first fetch span, linked to the others.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

from cachetools import FIFOCache
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind

from trajbus.infra import tracing
from trajbus.streams.wire.headers import GROUP_TRACEPARENTS, decode_traceparents

HELD = 4096
"""Fetched groups whose spans are kept for a conversion (a trainer that never converts drops the oldest)."""


def group_parents(headers: Any) -> dict[str, str]:
    """The ``trajbus-traceparents`` header of a group record: trajectory uid -> traceparent ({} if none)."""
    return decode_traceparents(tracing.header_value(headers, GROUP_TRACEPARENTS))


class FetchTraces:
    """Fetch spans per trajectory, and their contexts until their group's batch is converted."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self._fetched: FIFOCache[tuple[int, int], list[trace.SpanContext]] = FIFOCache(HELD)

    def fetched(self, prompt_uid: str, uids: Iterable[str], partition: int, offset: int, headers: Any,
                asked_ns: int) -> None:
        """A group handed out (the record at ``offset``, its trajectories ``uids``), asked for at ``asked_ns``."""
        parents = group_parents(headers)
        contexts = []
        for uid in uids:
            parent = tracing.parent_context(uid, tracing.context_from_traceparent(parents.get(uid)))
            span = tracing.tracer().start_span(tracing.FETCH, context=parent, kind=SpanKind.CONSUMER,
                                               start_time=asked_ns, attributes={
                                                   tracing.TRAJECTORY_UID: uid, tracing.PROMPT_UID: prompt_uid,
                                                   tracing.CHANNEL: self.channel, tracing.PARTITION: partition,
                                                   tracing.OFFSET: offset})
            span.end()
            contexts.append(span.get_span_context())
        self._fetched[(partition, offset)] = contexts

    @contextlib.contextmanager
    def converting(self, places: Iterable[tuple[int, int]]) -> Iterator[None]:
        """The conversion of the groups at ``places`` ((partition, offset) each) into one batch."""
        contexts = [c for place in places for c in self._fetched.pop(place, [])]
        parent = trace.set_span_in_context(trace.NonRecordingSpan(contexts[0])) if contexts else None
        span = tracing.tracer().start_span(tracing.CONVERT, context=parent, links=[Link(c) for c in contexts[1:]],
                                           attributes={tracing.CHANNEL: self.channel})
        with trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
            yield


def fetch_traces(channel: str) -> FetchTraces | None:
    """The consumer's spans when tracing is on, else None."""
    return FetchTraces(channel) if tracing.enabled() else None
