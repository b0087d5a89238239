"""rLLM traces <-> trajbus Steps (consumers.rllm.traces): the mapping, through the wire codec, and its refusals."""

from __future__ import annotations

import pytest

from trajbus.consumers.rllm.traces import (DELETED, ENDED, TRACE_KEY, entry_of, event_metadata, event_of, lineage,
                                           new_incarnation, trace_step)
from trajbus.streams.wire import codec
from trajbus.streams.wire.ledger import ABANDON
from trajbus.streams.wire.records import CONTINUES, SEGMENT_START, Step, TrajectoryEnd


def rllm_trace(**changes) -> dict:
    """A trace as rLLM's gateway stores it (``TraceRecord.model_dump()``); log-probs float32-exact, as engines give."""
    trace = {
        "trace_id": "tr-1", "session_id": "task-7:0", "model": "qwen",
        "messages": [{"role": "user", "content": "2+2?"}],
        "prompt_token_ids": [151644, 872, 198, 17, 10, 17, 30],
        "response_message": {"role": "assistant", "content": "4"},
        "completion_token_ids": [19, 151645],
        "logprobs": [-0.5, -0.125], "routing_matrices": None, "finish_reason": "stop", "weight_version": 3,
        "latency_ms": 12.5, "token_counts": {"prompt": 7, "completion": 2}, "timestamp": 1764000000.25,
        "metadata": {}, "raw_request": {"model": "qwen", "logprobs": True}, "raw_response": None,
    }
    trace.update(changes)
    return trace


def through_the_wire(step: Step) -> Step:
    decoded = codec.decode(codec.encode(step))
    assert isinstance(decoded, Step)
    return decoded


def test_a_trace_is_a_step_with_the_token_fields_in_place():
    step = trace_step("tr-1", "task-7:0", rllm_trace(), "task-7:0@ab12cd34", 4, created_at=1764000001.5)
    assert (step.prompt_ids, step.response_ids) == ([151644, 872, 198, 17, 10, 17, 30], [19, 151645])
    assert step.rollout_log_probs == [-0.5, -0.125]
    assert step.policy_version == 3
    assert (step.trajectory_uid, step.prompt_uid, step.step_index) == ("task-7:0@ab12cd34", "task-7:0@ab12cd34", 4)
    assert step.n_rollouts == 1 and step.created_at == 1764000001.5 and not step.is_last
    mark = step.metadata[TRACE_KEY]
    assert (mark["trace_id"], mark["session_id"]) == ("tr-1", "task-7:0")
    assert "prompt_token_ids" not in mark["trace"] and mark["trace"]["messages"] == rllm_trace()["messages"]


def test_the_trace_comes_back_whole_from_the_wire():
    step = through_the_wire(trace_step("tr-1", "task-7:0", rllm_trace(), "task-7:0@ab12cd34", 0))
    entry = entry_of(step)
    assert entry is not None
    assert (entry.trace_id, entry.session_id, entry.trajectory_uid) == ("tr-1", "task-7:0", "task-7:0@ab12cd34")
    assert entry.data() == rllm_trace()
    assert entry.data() is not entry.data()  # a new dict each time: a caller cannot change the store's


@pytest.mark.parametrize("changes, absent", [
    ({"weight_version": None, "logprobs": None}, ()),  # None stays None
    ({}, ("weight_version", "logprobs")),  # missing stays missing (rLLM 0.1.0's TraceRecord has no weight_version)
])
def test_optional_fields_come_back_as_they_were_given(changes, absent):
    trace = {k: v for k, v in rllm_trace(**changes).items() if k not in absent}
    step = trace_step("tr-1", "s", trace, "s@1", 0)
    assert step.policy_version == 0 and step.rollout_log_probs is None
    assert entry_of(through_the_wire(step)).data() == trace


def test_log_probs_come_back_as_float32():
    step = through_the_wire(trace_step("tr-1", "s", rllm_trace(logprobs=[-0.1, -2.3]), "s@1", 0))
    assert entry_of(step).data()["logprobs"] == pytest.approx([-0.1, -2.3], abs=1e-6)


@pytest.mark.parametrize("changes, match", [
    ({"completion_token_ids": []}, "^completion_token_ids: a trace on trajbus needs the sampled token ids"),
    ({"completion_token_ids": None}, "^completion_token_ids: a trace on trajbus needs its token ids as a list"),
    ({"prompt_token_ids": "hi"}, "^prompt_token_ids: "),
    ({"prompt_token_ids": [1, -2]}, r"^prompt_token_ids\[1\]: "),
    ({"completion_token_ids": [1, 2.5]}, r"^completion_token_ids\[1\]: "),
    ({"logprobs": [-0.5]}, "^logprobs: has 1 values for 2 response tokens"),
    ({"logprobs": [-0.5, "x"]}, r"^logprobs\[1\]: "),
    ({"weight_version": "3"}, "^weight_version: "),
    ({"weight_version": True}, "^weight_version: "),
    ({"metadata": {"when": object()}}, "^trace: must be JSON-serialisable"),
])
def test_a_trace_no_trainer_can_use_is_refused_in_rllm_words(changes, match):
    with pytest.raises(ValueError, match=match):
        trace_step("tr-1", "s", rllm_trace(**changes), "s@1", 0)


@pytest.mark.parametrize("trace_id, session_id, data, match", [
    ("", "s", {}, "^trace_id: "),
    ("t", None, {}, "^session_id: "),
    ("t", "s", [1], "^data: a trace is a dict"),
])
def test_names_and_data_are_checked(trace_id, session_id, data, match):
    with pytest.raises(ValueError, match=match):
        trace_step(trace_id, session_id, data, "s@1", 0)


def test_a_step_no_rllm_store_wrote_is_no_trace():
    assert entry_of(Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p")) is None
    assert entry_of(Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p",
                         metadata={TRACE_KEY: "something else"})) is None


def test_incarnations_are_new_each_time_and_name_their_session():
    first, second = new_incarnation("task-7:0"), new_incarnation("task-7:0")
    assert first != second and first.startswith("task-7:0@") and second.startswith("task-7:0@")


def test_session_events_read_back_and_a_deletion_is_an_abandon_event():
    deleted = TrajectoryEnd(trajectory_uid="*", prompt_uid="s@1", metadata=event_metadata("s", DELETED, "e1"))
    ended = TrajectoryEnd(trajectory_uid="s@1", prompt_uid="s@1", metadata=event_metadata("s", ENDED, "e2"))
    assert ABANDON in deleted.metadata and ABANDON not in ended.metadata
    assert event_of(codec.decode(codec.encode(deleted.validate()))) == ("s", DELETED, "e1")
    assert event_of(codec.decode(codec.encode(ended.validate()))) == ("s", ENDED, "e2")
    assert event_of(TrajectoryEnd(trajectory_uid="t", prompt_uid="p")) is None


def test_lineage_says_how_a_prompt_stands_to_the_previous_trace():
    previous = entry_of(trace_step("tr-1", "s", rllm_trace(), "s@1", 2))
    context = previous.context()
    assert context == rllm_trace()["prompt_token_ids"] + rllm_trace()["completion_token_ids"]
    assert lineage(None, 0, [1, 2]) == {}
    assert lineage(previous, 3, context + [198, 42]) == {}  # the agent kept its history: one training row
    assert lineage(previous, 5, context + [42]) == {CONTINUES: 2}  # steps 3-4 were lost on the way
    assert lineage(previous, 3, [151644, 42]) == {SEGMENT_START: True}  # the agent edited its history
