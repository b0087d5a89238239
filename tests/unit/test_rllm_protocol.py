"""KafkaTraceStore against rllm_model_gateway's own ``TraceStore`` protocol, checked structurally."""

from __future__ import annotations

import inspect
import typing

from rllm_model_gateway.store.base import TraceStore

from trajbus.consumers.rllm import KafkaTraceStore


def protocol_methods() -> list[str]:
    return sorted(name for name, value in vars(TraceStore).items()
                  if inspect.isfunction(value) and not name.startswith("_"))


def test_rllms_protocol_is_the_one_this_store_was_written_against():
    assert protocol_methods() == ["close", "delete_session", "flush", "get_session_traces", "get_trace",
                                  "list_sessions", "store_trace"]


def test_every_method_has_the_protocols_signature_and_is_a_coroutine():
    for name in protocol_methods():
        theirs, ours = getattr(TraceStore, name), getattr(KafkaTraceStore, name)
        assert inspect.iscoroutinefunction(ours), name
        assert [(p.name, p.kind, p.default) for p in inspect.signature(ours).parameters.values()] == \
               [(p.name, p.kind, p.default) for p in inspect.signature(theirs).parameters.values()], name
        assert typing.get_type_hints(ours) == typing.get_type_hints(theirs), name
