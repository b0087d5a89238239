"""The wire format: round trips, compact token ids, and clear errors for bad bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from trajbus.streams.wire import codec
from trajbus.streams.wire.records import ReadyGroup, Step, TrajectoryEnd


def make_step(**overrides) -> Step:
    fields = dict(prompt_ids=[1, 2, 3], response_ids=[4, 5], trajectory_uid="traj-1", prompt_uid="prompt-1",
                  step_index=2, reward=0.5, policy_version=7, is_last=True, metadata={"env": "math", "ü": [1, 2]},
                  rollout_log_probs=[-0.25, -1.5], created_at=1700000000.125, channel="train", n_rollouts=4)
    fields.update(overrides)
    return Step(**fields)


def test_step_round_trip_keeps_every_field():
    step = make_step()
    assert codec.decode(codec.encode(step)) == step


def test_step_without_optional_fields_round_trips_to_none():
    step = make_step(rollout_log_probs=None, channel=None, n_rollouts=None, metadata={}, is_last=False)
    decoded = codec.decode(codec.encode(step))
    assert decoded == step
    assert decoded.rollout_log_probs is None and decoded.channel is None and decoded.n_rollouts is None


@pytest.mark.parametrize("top_id, width", [(255, 1), (256, 2), (65535, 2), (65536, 4), (2**32 - 1, 4)])
def test_token_ids_use_the_narrowest_width(top_id, width):
    ids = [0, 17, top_id] * 100
    empty = codec.encode(make_step(prompt_ids=[], response_ids=[], rollout_log_probs=None))
    full = codec.encode(make_step(prompt_ids=ids, response_ids=[], rollout_log_probs=None))
    assert len(full) - len(empty) == width * len(ids) + 1  # + one more varint byte for count 300
    assert codec.decode(full).prompt_ids == ids


def test_log_probs_are_float32():
    values = [float(np.float32(v)) for v in (-0.1, -3.3, -12.75)]
    step = make_step(response_ids=[9, 8, 7], rollout_log_probs=values)
    assert codec.decode(codec.encode(step)).rollout_log_probs == values


def test_trajectory_end_round_trip_with_and_without_reward():
    end = TrajectoryEnd(trajectory_uid="t", prompt_uid="p", reward=1.0, created_at=5.0, channel="val",
                        n_rollouts=2, metadata={"why": "done"})
    assert codec.decode(codec.encode(end)) == end
    no_reward = TrajectoryEnd(trajectory_uid="t", prompt_uid="p", created_at=5.0)
    assert codec.decode(codec.encode(no_reward)).reward is None


def test_ready_group_round_trip():
    steps = [make_step(trajectory_uid=f"t{i}", step_index=0) for i in range(3)]
    group = ReadyGroup(prompt_uid="prompt-1", channel="train", steps=steps, n_rollouts=3, ready_at=12.5,
                       status="partial", metadata={"tags": ["stale"]})
    decoded = codec.decode(codec.encode(group))
    assert decoded == group
    assert decoded.trajectory_uids == ["t0", "t1", "t2"]


def test_headers_name_schema_version_and_content_type():
    headers = dict(codec.headers_for(make_step()))
    assert headers["trajbus-schema-version"] == b"2"
    assert headers["content-type"] == b"application/vnd.trajbus.step; v=2"
    group_headers = dict(codec.headers_for(ReadyGroup("p", "train", [], 1)))
    assert group_headers["content-type"].startswith(b"application/vnd.trajbus.ready-group")


def test_binary_is_smaller_than_json_for_token_ids():
    import json
    from dataclasses import asdict

    step = make_step(prompt_ids=list(range(20000, 22048)), response_ids=list(range(512)),
                     rollout_log_probs=[-0.5] * 512)
    assert len(codec.encode(step)) < len(json.dumps(asdict(step))) / 2


@pytest.mark.parametrize("value, reason", [
    (b"", "empty value"),
    (b"garbage!", "bad magic"),
    (b"TB", "shorter than"),
    (struct.pack("<2sBB", b"TB", 9, 1), "schema version 9"),
    (struct.pack("<2sBB", b"TB", 1, 42), "unknown record kind 42"),
])
def test_decode_errors_say_why(value, reason):
    with pytest.raises(codec.DecodeError, match=reason):
        codec.decode(value)


def test_truncated_and_padded_values_are_refused():
    data = codec.encode(make_step())
    for cut in (5, len(data) // 2, len(data) - 1):
        with pytest.raises(codec.DecodeError):
            codec.decode(data[:cut])
    with pytest.raises(codec.DecodeError, match="trailing"):
        codec.decode(data + b"\x00")


def test_bad_token_width_is_refused():
    data = bytearray(codec.encode(make_step(channel=None, metadata={}, rollout_log_probs=None)))
    header = 4 + len(b"\x06traj-1\x08prompt-1\x00") + struct.calcsize("<IqdBId") + 1  # + the prompt form
    assert data[header] == 1  # width byte of prompt_ids
    data[header] = 3
    with pytest.raises(codec.DecodeError, match="width 3"):
        codec.decode(bytes(data))


def as_version_1(value: bytes, prompt_at: int) -> bytes:
    """A v2 value of a whole-prompt step as schema v1 wrote it: version 1, no prompt-form byte."""
    assert value[prompt_at] == 0
    return value[:2] + b"\x01" + value[3:prompt_at] + value[prompt_at + 1:]


def test_version_1_values_still_decode():
    step = make_step(channel=None, metadata={})
    v1 = as_version_1(codec.encode(step), 4 + len(b"\x06traj-1\x08prompt-1\x00") + struct.calcsize("<IqdBId"))
    assert codec.decode(v1) == step


def test_a_steps_topic_record_cannot_extend_a_group_prompt():
    data = bytearray(codec.encode(make_step(channel=None, metadata={})))
    data[4 + len(b"\x06traj-1\x08prompt-1\x00") + struct.calcsize("<IqdBId")] = 2
    with pytest.raises(codec.DecodeError, match="shared prompt"):
        codec.decode(bytes(data))


def test_metadata_is_written_as_the_standard_librarys_json_reads_it_back_beyond_orjsons_range():
    """A step's metadata is written by orjson, and by the standard library when orjson cannot (an integer past
    64 bits): either way it decodes equal. A value that is no JSON type is still refused by the step's check,
    though orjson could write it (a UUID as a string) or would write NaN as null."""
    import uuid

    for metadata in ({"finish_reason": "stop", "continues": 3, "note": "é✓\n", "nested": [1.5, None, True]},
                     {"big": 2**70, "tuple": [1, 2]}):
        step = Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p", metadata=metadata)
        assert codec.decode(codec.encode(step)).metadata == metadata
    for bad in ({"id": uuid.uuid4()}, {"x": float("nan")}, {"x": [float("inf")]}):
        with pytest.raises(ValueError, match="^metadata: must be JSON-serialisable"):
            Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p", metadata=bad).validate()
