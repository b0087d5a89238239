"""Traces that cannot be a training step, kept on a topic of the rLLM store's own: ``{prefix}.rllm.{channel}``.

rLLM's gateway stores every call's trace, also one no trainer can use: a passthrough call, or an engine
that returns no token ids (``prompt_token_ids`` None, ``completion_token_ids`` empty), log-probs not one
per completion token, a weight version that is no integer. rLLM's stores keep them and give them back,
so this store does too, but not as a Step: on the steps topic trajbus's worker would dead-letter it at
best. Such a trace is a JSON record here, the trace exactly as given (floats and all) with the reason it
is no step; no worker reads this topic. The session events (end, delete) of a trajectory that has no
step on the steps topic are written here too, so the worker never sees an end or an abandon of a
trajectory it never saw. One partition, keyed by trajectory: a trajectory's records keep their order.

Nothing is silent: each such trace is counted in ``trajbus_rllm_untrainable_traces{channel,key}`` (and
``KafkaTraceStore.untrainable``), the first of each key logged as a warning by the store.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import Counter

from trajbus.infra.topics import TopicSpec
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.topics import validate_channel

__all__ = ["UNTRAINABLE", "KeptTrace", "event_value", "kept_event", "kept_spec", "kept_topic", "kept_trace",
           "read_kept"]

UNTRAINABLE = Counter("trajbus_rllm_untrainable_traces",
                      "rLLM traces stored off the training stream (no Step), by the trace key at fault",
                      ["channel", "key"])
KIND = "rllm"
"""The key of every record of the topic: ``trace``, or the session event (``ended``, ``deleted``)."""
_NAME = re.compile(r"\w+")


def kept_topic(channel: str, prefix: str) -> str:
    return f"{prefix}.rllm.{validate_channel(channel)}"


def kept_spec(settings: TopicSettings, channel: str) -> TopicSpec:
    """One partition (read whole by every store), retained as long as the steps topic."""
    return settings.spec(kept_topic(channel, settings.prefix), 1, {
        "cleanup.policy": "delete", "retention.ms": str(settings.steps_retention_ms),
        "max.message.bytes": str(settings.max_message_bytes)})


@dataclass(frozen=True)
class KeptTrace:
    """A stored trace that is no step: its JSON as given, where it sits in its session, and why."""

    trace_id: str
    session_id: str
    trajectory_uid: str
    step_index: int
    """The step index the trajectory's next step gets (it takes none itself): orders it among the steps."""
    created_at: float
    reason: str
    raw: bytes

    def data(self) -> dict[str, Any]:
        """The trace dict, a new one on every call (nothing shared with the store)."""
        return orjson.loads(self.raw)

    @property
    def key(self) -> str:
        """The trace key at fault (``prompt_token_ids``, ``logprobs``...): the metric's label."""
        found = _NAME.match(self.reason)
        return found.group(0) if found else "trace"

    @property
    def sort_key(self) -> tuple[float, int]:
        return (self.created_at, self.step_index)


def kept_trace(trace_id: str, session_id: str, data: dict[str, Any], trajectory_uid: str, step_index: int,
               reason: str, created_at: float | None = None) -> tuple[KeptTrace, bytes]:
    """The entry and its record; ``ValueError`` when JSON would not give the trace back as it is."""
    try:
        raw = orjson.dumps(data)
        faithful = orjson.loads(raw) == data
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise ValueError(f"data: a trace that is no training step ({reason}) is kept as JSON, and this one "
                         f"is not: {exc}") from None
    if not faithful:
        raise ValueError(f"data: a trace that is no training step ({reason}) is kept as JSON, which would not "
                         f"give this one back as it is (a tuple, NaN or infinity)")
    entry = KeptTrace(trace_id, session_id, trajectory_uid, step_index,
                      time.time() if created_at is None else created_at, reason, raw)
    return entry, _record(entry)


def _record(entry: KeptTrace) -> bytes:
    head = orjson.dumps({KIND: "trace", "trace_id": entry.trace_id, "session_id": entry.session_id,
                         "trajectory_uid": entry.trajectory_uid, "step_index": entry.step_index,
                         "created_at": entry.created_at, "reason": entry.reason})
    return head[:-1] + b',"trace":' + entry.raw + b"}"  # the trace's bytes as checked, not encoded twice


def kept_event(session_id: str, kind: str, trajectory_uid: str, event_id: str) -> bytes:
    """A session event (``traces.ENDED`` / ``traces.DELETED``) of a trajectory with no step."""
    return orjson.dumps({KIND: kind, "session_id": session_id, "trajectory_uid": trajectory_uid, "id": event_id})


def event_value(record: dict[str, Any]) -> tuple[str, str, str, str] | None:
    """(session_id, kind, trajectory_uid, event id) of an event record, else None."""
    fields = (record.get("session_id"), record.get(KIND), record.get("trajectory_uid"), record.get("id"))
    return fields if all(isinstance(value, str) for value in fields) else None  # type: ignore[return-value]


def read_kept(value: bytes | None) -> KeptTrace | dict[str, Any] | None:
    """A record of the topic: a ``KeptTrace``, an event's dict (``event_value``), or None (not ours)."""
    try:
        record = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get(KIND), str):
        return None
    if record[KIND] != "trace":
        return record
    names = ("trace_id", "session_id", "trajectory_uid", "reason")
    if not all(isinstance(record.get(name), str) for name in names) or not isinstance(record.get("trace"), dict) \
            or type(record.get("step_index")) is not int or not isinstance(record.get("created_at"), (int, float)):
        return None
    return KeptTrace(record["trace_id"], record["session_id"], record["trajectory_uid"], record["step_index"],
                     float(record["created_at"]), record["reason"], orjson.dumps(record["trace"]))
