"""rLLM traces as trajbus Steps and back: the pure mapping of ``consumers.rllm``.

A trace is the dict rLLM's model gateway hands its store (``TraceRecord.model_dump()``). On the
steps topic it is one ``Step``, so trajbus's worker, consumers, ``tail`` and ``replay`` read it as
they read the gateway's own steps:

=====================  ==================================================================
trace                  Step
=====================  ==================================================================
prompt_token_ids       ``prompt_ids``
completion_token_ids   ``response_ids`` (at least one: else the trace is no step, ``kept``)
logprobs               ``rollout_log_probs`` (float32 on the wire, as engines report them)
weight_version         ``policy_version`` (None or missing: 0, and given back as it was)
session_id             ``trajectory_uid`` and ``prompt_uid``: the session's *incarnation*
                       ``{session_id}@{8 hex}``, a new one after ``delete_session`` or
                       ``end_session``, so a session id rLLM reuses is a new trajectory
store time             ``created_at`` (the record's timestamp; traces are ordered by it)
everything else        ``metadata["rllm"]["trace"]`` (JSON: messages, raw request/response, ...)
=====================  ==================================================================

Each incarnation is a prompt group of one trajectory (``n_rollouts=1``). ``metadata["rllm"]`` also
names the trace and its session, and which trace keys went into Step fields (``typed``), so a
trace comes back with exactly its keys. Session ends and deletions are ``TrajectoryEnd`` events
whose ``metadata["rllm"]`` says which (a deletion is the worker's *abandon* event too).
"""

from __future__ import annotations

import re
import secrets
import time
from array import array
from dataclasses import dataclass
from typing import Any

import orjson

from trajbus.streams.wire.ledger import ABANDON
from trajbus.streams.wire.records import CONTINUES, SEGMENT_START, Step, TrajectoryEnd

__all__ = ["DELETED", "ENDED", "TRACE_KEY", "TraceEntry", "check_ids", "event_metadata", "event_of", "entry_of",
           "lineage", "new_incarnation", "trace_step"]

TRACE_KEY = "rllm"
"""The Step / TrajectoryEnd metadata key under which a record says it belongs to an rLLM trace store."""
ENDED, DELETED = "ended", "deleted"
"""The two session events (``TrajectoryEnd`` records) the store writes."""
IDS = ("prompt_token_ids", "completion_token_ids")
_FIELD_NAMES = {"prompt_ids": "prompt_token_ids", "response_ids": "completion_token_ids",
                "rollout_log_probs": "logprobs", "policy_version": "weight_version", "metadata": "trace",
                "trajectory_uid": "session_id", "prompt_uid": "session_id"}
_LEADING_NAME = re.compile(r"^(\w+)")


def new_incarnation(session_id: str) -> str:
    """The trajectory_uid (and prompt_uid) of a session's next incarnation."""
    return f"{session_id}@{secrets.token_hex(4)}"


def _in_rllm_words(exc: ValueError) -> ValueError:
    """A Step's refusal named by the trace key the user wrote (``prompt_ids`` -> ``prompt_token_ids``)."""
    text = _LEADING_NAME.sub(lambda m: _FIELD_NAMES.get(m.group(1), m.group(1)), str(exc), count=1)
    return ValueError(text)


def _check_ids(data: dict[str, Any]) -> None:
    for name in IDS:
        if not isinstance(data.get(name), list):
            raise ValueError(f"{name}: a trace on trajbus needs its token ids as a list, got "
                             f"{type(data.get(name)).__name__}")
    if not data["completion_token_ids"]:
        raise ValueError("completion_token_ids: a trace on trajbus needs the sampled token ids (rLLM's gateway "
                         "asks vLLM for them with add_return_token_ids), got []")


def check_ids(trace_id: object, session_id: object) -> None:
    """A trace and its session are named by non-empty strings (``ValueError`` otherwise)."""
    for name, value in (("trace_id", trace_id), ("session_id", session_id)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name}: must be a non-empty string, got {value!r}")


def trace_step(trace_id: str, session_id: str, data: dict[str, Any], trajectory_uid: str, step_index: int,
               created_at: float | None = None) -> Step:
    """The Step that carries ``data``, checked; a ``ValueError`` names the trace key at fault (such a trace
    is no training step: the store keeps it on its own topic, ``consumers.rllm.kept``)."""
    check_ids(trace_id, session_id)
    if not isinstance(data, dict):
        raise ValueError(f"data: a trace is a dict, got {type(data).__name__}")
    _check_ids(data)
    typed = list(IDS)
    log_probs = data.get("logprobs")
    if isinstance(log_probs, list):
        typed.append("logprobs")
    version = data.get("weight_version")
    if version is not None:
        typed.append("weight_version")
    rest = {key: value for key, value in data.items() if key not in typed}
    step = Step(prompt_ids=data["prompt_token_ids"], response_ids=data["completion_token_ids"],
                trajectory_uid=trajectory_uid, prompt_uid=trajectory_uid, step_index=step_index,
                policy_version=version if version is not None else 0,
                rollout_log_probs=log_probs if "logprobs" in typed else None, n_rollouts=1,
                created_at=time.time() if created_at is None else created_at,
                metadata={TRACE_KEY: {"trace_id": trace_id, "session_id": session_id, "typed": typed,
                                      "trace": rest}})
    try:
        return step.validate()
    except ValueError as exc:
        raise _in_rllm_words(exc) from None


@dataclass(frozen=True)
class TraceEntry:
    """A trace as a store keeps it: ids and log-probs packed (4 bytes a value), the rest as JSON bytes."""

    trace_id: str
    session_id: str
    trajectory_uid: str
    step_index: int
    created_at: float
    prompt: array
    completion: array
    log_probs: array | None
    policy_version: int
    typed: tuple[str, ...]
    rest: bytes

    def data(self) -> dict[str, Any]:
        """The trace dict, a new one on every call (nothing shared with the store)."""
        data = orjson.loads(self.rest)
        data["prompt_token_ids"] = self.prompt.tolist()
        data["completion_token_ids"] = self.completion.tolist()
        if "logprobs" in self.typed and self.log_probs is not None:
            data["logprobs"] = self.log_probs.tolist()
        if "weight_version" in self.typed:
            data["weight_version"] = self.policy_version
        return data

    def context(self) -> list[int]:
        """Prompt + completion: what the session's next prompt extends when the agent kept its history."""
        return self.prompt.tolist() + self.completion.tolist()

    @property
    def sort_key(self) -> tuple[float, int]:
        return (self.created_at, self.step_index)


def entry_of(step: Step) -> TraceEntry | None:
    """The trace a (full) step carries, or None for a step no rLLM store wrote."""
    mark = step.metadata.get(TRACE_KEY)
    if not isinstance(mark, dict) or not isinstance(mark.get("trace"), dict) or \
            not isinstance(mark.get("trace_id"), str) or not isinstance(mark.get("session_id"), str):
        return None
    log_probs = array("f", step.rollout_log_probs) if step.rollout_log_probs is not None else None
    return TraceEntry(mark["trace_id"], mark["session_id"], step.trajectory_uid, step.step_index, step.created_at,
                      array("I", step.prompt_ids), array("I", step.response_ids), log_probs, step.policy_version,
                      tuple(mark.get("typed", IDS)), orjson.dumps(mark["trace"]))


def event_metadata(session_id: str, kind: str, event_id: str) -> dict[str, Any]:
    """The metadata of a session event; a deletion is also the worker's abandon event for the incarnation."""
    mark = {TRACE_KEY: {"session_id": session_id, "event": kind, "id": event_id}}
    return {ABANDON: "rllm delete_session", **mark} if kind == DELETED else mark


def event_of(end: TrajectoryEnd) -> tuple[str, str, str] | None:
    """(session_id, kind, event id) of a session event the store wrote, else None."""
    mark = end.metadata.get(TRACE_KEY)
    if not isinstance(mark, dict) or mark.get("event") not in (ENDED, DELETED) or \
            not isinstance(mark.get("session_id"), str):
        return None
    return mark["session_id"], mark["event"], str(mark.get("id"))


def lineage(previous: TraceEntry | None, step_index: int, prompt_ids: list[int]) -> dict[str, Any]:
    """How trace ``step_index`` stands to the incarnation's last one, as the gateway writes it: nothing when
    its prompt extends that trace's prompt + completion (one training row), ``CONTINUES`` when that trace is
    not ``step_index - 1``, ``SEGMENT_START`` when the prompt does not extend it (the agent edited its history)."""
    if previous is None:
        return {}
    context = previous.context()
    if prompt_ids[:len(context)] != context:
        return {SEGMENT_START: True}
    return {CONTINUES: previous.step_index} if previous.step_index != step_index - 1 else {}
