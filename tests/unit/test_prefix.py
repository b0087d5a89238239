"""Prefix sharing (schema v2): what writers store, what readers rebuild, and what they refuse."""

from __future__ import annotations

import dataclasses
from array import array

import pytest

from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import (KEYFRAME_EVERY, PROMPT_EXTENDS_SHARED, PROMPT_EXTENDS_STEP, PROMPT_FULL,
                                         PrefixEncoder, PrefixError, PrefixResolver, StepDelta, regroup, step_of)
from trajbus.streams.wire.records import ReadyGroup, Step

TASK = list(range(70_000, 70_500))  # ids past 65,535: 4 bytes each


def trajectory(uid: str, turns: int, response: int = 40, tool: int = 60, start: float = 1000.0) -> list[Step]:
    """A multi-turn rollout: each prompt is the previous prompt + response + a tool output; turn t is
    created at ``start + t`` (on a broker, give a recent ``start``: retention deletes 1970 at once)."""
    steps, prompt = [], list(TASK)
    for turn in range(turns):
        reply = [100_000 + 1000 * turn + i for i in range(response)]
        steps.append(Step(prompt_ids=list(prompt), response_ids=reply, trajectory_uid=uid, prompt_uid="p",
                          step_index=turn, rollout_log_probs=[-0.5] * response, is_last=turn == turns - 1,
                          created_at=start + turn))
        prompt += reply + [120_000 + 1000 * turn + i for i in range(tool)]
    return steps


def sent(steps: list[Step], encoder: PrefixEncoder | None = None) -> list[bytes]:
    encoder = encoder or PrefixEncoder()
    return [codec.encode(encoder.delta(step)) for step in steps]


def test_each_turn_stores_only_its_new_tokens_and_reads_back_whole():
    steps = trajectory("t", 6)
    values = sent(steps)
    whole = [len(codec.encode(step)) for step in steps]
    assert values[0] == codec.encode(steps[0])  # a trajectory's first step is a keyframe
    for value, step in zip(values[1:], steps[1:]):  # tool output + response + log-probs, plus fixed fields
        assert len(value) < 4 * (60 + 40) + 4 * 40 + 150 < len(codec.encode(step))
    assert sum(len(v) for v in values) < sum(whole) / 3
    resolver = PrefixResolver()
    assert [resolver.resolve(codec.decode(v)) for v in values] == steps


def test_a_keyframe_bounds_how_far_back_a_reader_resolves():
    records = [codec.decode(v) for v in sent(trajectory("t", KEYFRAME_EVERY + 3))]
    keyframes = [i for i, r in enumerate(records) if isinstance(r, Step)]
    assert keyframes == [0, KEYFRAME_EVERY]
    tail = PrefixResolver()  # a reader that starts at the keyframe needs nothing before it
    assert [tail.resolve(r).step_index for r in records[KEYFRAME_EVERY:]] == list(range(KEYFRAME_EVERY,
                                                                                        KEYFRAME_EVERY + 3))
    assert records[-1].keyframe_at == 1000.0 + KEYFRAME_EVERY  # where to look it up by time


def test_a_forgotten_or_ended_trajectory_starts_again_with_a_keyframe():
    encoder = PrefixEncoder()
    first, second, third = trajectory("t", 3)
    encoder.delta(first)
    encoder.forget("t")  # e.g. its last call was not acknowledged
    assert encoder.delta(second).kind == PROMPT_FULL
    assert encoder.delta(third).kind == PROMPT_EXTENDS_STEP and third.is_last
    assert encoder.memory.bytes == 0  # the last step frees the trajectory


def test_memory_is_bounded_least_recently_used_out():
    encoder = PrefixEncoder(max_bytes=10_000)  # one context of ~600 tokens x 4 bytes fits, not five
    for uid in "abcde":
        encoder.delta(trajectory(uid, 2)[0])
    assert encoder.memory.bytes <= 10_000 and "a" not in encoder.memory.by_trajectory
    assert encoder.delta(trajectory("a", 2)[1]).kind == PROMPT_FULL
    assert encoder.delta(trajectory("e", 2)[1]).kind == PROMPT_EXTENDS_STEP


def test_a_context_larger_than_the_whole_bound_is_not_kept_and_the_next_step_is_whole():
    encoder = PrefixEncoder(max_bytes=1_000)  # one context of ~600 tokens is ~4,800 bytes
    first, second = trajectory("t", 2)
    assert encoder.delta(first).kind == PROMPT_FULL
    assert encoder.memory.bytes == 0 and "t" not in encoder.memory.by_trajectory
    assert encoder.delta(second).kind == PROMPT_FULL


def test_a_reader_refuses_a_step_whose_base_it_has_not_read_or_is_too_short():
    records = [codec.decode(v) for v in sent(trajectory("t", 3))]
    with pytest.raises(PrefixError, match="extends step 1, which was not read"):
        PrefixResolver().resolve(records[2])
    resolver = PrefixResolver()
    resolver.resolve(records[0])
    records[1].prefix_len = 10_000
    with pytest.raises(PrefixError, match="a prefix of 10000 tokens of step 0"):
        resolver.resolve(records[1])


def test_a_group_stores_the_shared_prompt_once_and_each_trajectory_once():
    steps = [s for uid in ("a", "b", "c", "d") for s in trajectory(uid, 5)]
    group = ReadyGroup("p", "train", steps, 4, ready_at=1.0)
    value = codec.encode(group)
    distinct = 4 * len(TASK) + 4 * 5 * (4 * (40 + 60) + 4 * 40)  # the task once; per turn ids + log-probs
    assert len(value) < 1.25 * distinct
    assert codec.decode(value) == group


def test_the_worker_regroups_stored_deltas_without_rebuilding_prompts():  # decoded as the worker does: arrays
    records = [codec.decode(v, arrays=True) for uid in ("a", "b") for v in sent(trajectory(uid, 4))]
    shared, entries = regroup(records, [])
    assert [e.kind for e in entries] == [PROMPT_EXTENDS_SHARED] + [PROMPT_EXTENDS_STEP] * 3 + \
        [PROMPT_EXTENDS_SHARED] + [PROMPT_EXTENDS_STEP] * 3
    assert all(e.step.prompt_ids is r.step.prompt_ids for e, r in zip(entries, records)
               if isinstance(r, StepDelta))  # the tokens as stored, not a rebuilt prompt
    group = ReadyGroup("p", "train", [step_of(r) for r in records], 2, ready_at=1.0)
    value = codec.preamble(codec.KIND_READY_GROUP) + codec.encode_group_body(group, shared, entries)
    assert codec.decode(value).steps == trajectory("a", 4) + trajectory("b", 4)


def test_a_step_whose_base_is_left_out_of_the_group_is_rebuilt_from_its_trajectory():
    records = [codec.decode(v, arrays=True) for v in sent(trajectory("a", 4))]
    chosen = [records[0], records[2], records[3]]  # step 1 left out (its trajectory's end did not name it)
    with pytest.raises(PrefixError, match="not among its trajectory's records"):
        regroup(chosen, [])
    shared, entries = regroup(chosen, [records[1]])
    group = ReadyGroup("p", "train", [step_of(r) for r in chosen], 1, ready_at=1.0)
    value = codec.preamble(codec.KIND_READY_GROUP) + codec.encode_group_body(group, shared, entries)
    full = trajectory("a", 4)
    assert codec.decode(value).steps == [full[0], full[2], full[3]]


def test_a_stored_prefix_longer_than_its_base_is_refused_by_the_worker():
    records = [codec.decode(v, arrays=True) for v in sent(trajectory("a", 2))]
    records[1].prefix_len = 10_000
    with pytest.raises(PrefixError, match="a prefix of 10000 tokens of step 0"):
        regroup(records, [])


def test_a_keyframe_inside_a_group_is_stored_against_the_step_before_it():
    values = sent(trajectory("a", 5), PrefixEncoder(keyframe_every=3))
    records = [codec.decode(v, arrays=True) for v in values]
    assert [isinstance(r, Step) for r in records] == [True, False, False, True, False]
    shared, entries = regroup(records, [])
    assert (entries[3].kind, entries[3].base_index) == (PROMPT_EXTENDS_STEP, 2)
    assert len(entries[3].step.prompt_ids) == 60  # only the tool output after step 2's response
    group = ReadyGroup("p", "train", [step_of(r) for r in records], 1, ready_at=1.0)
    value = codec.preamble(codec.KIND_READY_GROUP) + codec.encode_group_body(group, shared, entries)
    assert codec.decode(value).steps == trajectory("a", 5)


def test_a_producer_whose_send_failed_writes_the_trajectorys_next_step_whole():
    from trajbus.streams.client.producer import DeliveryError, StepProducer

    first, second = trajectory("t", 3)[:2]
    with StepProducer("127.0.0.1:1", timeout=0.5, provision_topics=False) as producer:  # nobody listens
        producer._reached = True  # its cluster answered once, then went away: the send itself fails
        with pytest.raises(DeliveryError, match="not acknowledged"):
            producer.submit_steps([first], channel="train")
        assert producer._prefixes.delta(second).kind == PROMPT_FULL  # step 0 may never have arrived


def test_a_turn_that_extends_the_last_context_sent_is_validated_from_its_new_tokens_on():
    encoder = PrefixEncoder()
    steps = trajectory("t", 3)
    encoder.delta(steps[0])
    known = len(steps[0].prompt_ids) + len(steps[0].response_ids)
    assert encoder.extended(steps[1]) == known
    bad_tail = dataclasses.replace(steps[1], prompt_ids=steps[1].prompt_ids[:-1] + [-1])
    with pytest.raises(ValueError, match=rf"^prompt_ids\[{len(bad_tail.prompt_ids) - 1}\]: "):
        bad_tail.validate(known_prefix=encoder.extended(bad_tail))
    edited = dataclasses.replace(steps[1], prompt_ids=[-1] + steps[1].prompt_ids[1:])
    assert encoder.extended(edited) == 0  # not the context sent: every token is checked
    with pytest.raises(ValueError, match=r"^prompt_ids\[0\]: "):
        edited.validate(known_prefix=encoder.extended(edited))
    assert encoder.extended(trajectory("other", 2)[1]) == 0


def as_the_gateway_builds(step: Step) -> Step:
    """The step as the gateway builds it: its prompt and response token arrays (``gateway.prompts.token_ids``),
    its log-probs a float array (``TrajectoryLifecycle.publish_call``)."""
    return dataclasses.replace(step, prompt_ids=array("I", step.prompt_ids), response_ids=array("I", step.response_ids),
                               rollout_log_probs=array("d", step.rollout_log_probs))


@pytest.mark.parametrize("turn", ["continued", "new segment", "cut and continued"])
def test_a_step_whose_ids_and_log_probs_are_arrays_goes_on_the_wire_as_its_list_twin_does(turn):
    steps = trajectory("t", 3)
    third = steps[2].prompt_ids
    steps[2] = dataclasses.replace(steps[2], prompt_ids={
        "continued": third, "new segment": [5] * 300, "cut and continued": third[:len(TASK) + 20] + [9] * 50}[turn])
    as_lists, as_arrays = PrefixEncoder(), PrefixEncoder()
    values = [codec.encode(as_lists.delta(step)) for step in steps]
    deltas = [as_arrays.delta(as_the_gateway_builds(step)) for step in steps]
    assert [codec.encode(delta) for delta in deltas] == values  # the same bytes
    kind, prefix = {"continued": (PROMPT_EXTENDS_STEP, len(steps[1].prompt_ids) + 40),
                    "new segment": (PROMPT_FULL, 0), "cut and continued": (PROMPT_EXTENDS_STEP, len(TASK) + 20)}[turn]
    assert (deltas[2].kind, deltas[2].prefix_len) == (kind, prefix)
    resolver = PrefixResolver()
    assert [resolver.resolve(codec.decode(value)) for value in values] == steps


def test_a_token_array_context_costs_4_bytes_a_token_and_its_turns_are_checked_from_their_new_tokens_on():
    steps = [as_the_gateway_builds(step) for step in trajectory("t", 3)]
    encoder = PrefixEncoder()
    encoder.delta(steps[0])
    context = len(steps[0].prompt_ids) + len(steps[0].response_ids)
    assert encoder.memory.bytes == 4 * context
    assert encoder.extended(steps[1]) == context
    assert encoder.extended(dataclasses.replace(steps[1], prompt_ids=array("I", [1]) + steps[1].prompt_ids[1:])) == 0
    assert Step.validate(steps[1]) is steps[1]
    with pytest.raises(ValueError, match="^prompt_ids: must be a list of token ids, got array"):
        dataclasses.replace(steps[1], prompt_ids=array("i", steps[1].prompt_ids)).validate()  # signed: not ids


def test_the_context_kept_for_the_last_step_sent_is_lent_to_a_caller_that_would_keep_it_too():
    steps = [as_the_gateway_builds(step) for step in trajectory("t", 3)]
    encoder = PrefixEncoder()
    encoder.delta(steps[0])
    kept = encoder.remembered("t", 0)
    assert kept == steps[0].prompt_ids + array("I", steps[0].response_ids)
    assert encoder.remembered("t", 1) is None and encoder.remembered("other", 0) is None
    encoder.delta(steps[1])
    assert encoder.remembered("t", 0) is None  # only the last step's: an earlier one is not kept
    assert kept == steps[0].prompt_ids + array("I", steps[0].response_ids)  # what was lent is never changed
    encoder.delta(steps[2])  # the last step: the trajectory is forgotten
    assert encoder.remembered("t", 2) is None
