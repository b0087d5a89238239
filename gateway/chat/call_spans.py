"""The spans of one agent call (``gateway.chat.completions``), made only when tracing is on (``infra.tracing``).

``trajbus.call`` is the agent's HTTP call: a child of the agent's own span when it sent ``traceparent``
(it joins the agent's trace), else of the trajectory's root, which the trajectory's first call exports.
``trajbus.engine`` (the engine request) and ``trajbus.publish`` (the steps sent until acknowledged) are
its children. Spans are started and ended explicitly, never left current across an ``await`` of a
streamed answer: only ``publishing`` makes its span current, around the publish, so the records'
``traceparent`` headers (``streams.client.sender``) name it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from trajbus.infra import tracing


class CallSpans:
    """One call's spans; ``end`` closes whatever is still open."""

    def __init__(self, trajectory: Any, traceparent: str | None, start_ns: int) -> None:
        uid = trajectory.trajectory_uid
        self.attributes = {tracing.TRAJECTORY_UID: uid, tracing.PROMPT_UID: trajectory.prompt_uid,
                           tracing.CHANNEL: trajectory.channel}
        if not trajectory.next_step:  # the trajectory's first call: its trace gets its root
            tracing.export_trajectory_root(uid, start_ns, self.attributes)
        parent = tracing.parent_context(uid, tracing.context_from_traceparent(traceparent))
        self.call = tracing.tracer().start_span(tracing.CALL, context=parent, kind=SpanKind.SERVER,
                                                start_time=start_ns, attributes=self.attributes)
        self.context = trace.set_span_in_context(self.call)
        self.engine: trace.Span | None = None

    def engine_started(self) -> None:
        if self.engine is None:
            self.engine = tracing.tracer().start_span(tracing.ENGINE, context=self.context, kind=SpanKind.CLIENT,
                                                      attributes=self.attributes)

    def engine_ended(self, backend: str | None, tokens: int) -> None:
        """The engine's answer is complete: its backend and the tokens it sampled."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.set_attributes({tracing.BACKEND: backend or "", tracing.TOKENS: tokens})
            engine.end()

    @contextlib.contextmanager
    def publishing(self) -> Iterator[trace.Span]:
        """The publish span, current for the body (which must not yield to another answer's code)."""
        span = tracing.tracer().start_span(tracing.PUBLISH, context=self.context, kind=SpanKind.PRODUCER,
                                           attributes=self.attributes)
        with trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
            yield span

    def end(self, error: BaseException | str | None = None) -> None:
        """The call answered (or failed with ``error``): its open spans end."""
        for span in (self.engine, self.call):
            if span is None:
                continue
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, getattr(error, "message", None) or str(error)))
            span.end()
        self.engine = None


def call_spans(trajectory: Any, traceparent: str | None, start_ns: int | None = None) -> CallSpans | None:
    """The call's spans when tracing is on, else None (the one check a call makes)."""
    if not tracing.enabled():
        return None
    return CallSpans(trajectory, traceparent, start_ns or time.time_ns())
