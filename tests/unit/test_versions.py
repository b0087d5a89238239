"""Version segments (which policy version sampled which response token): the rules, on the wire, in a
trainer's rows and tensors, and the importance weights that follow them, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.off_policy import importance_weights
from trajbus.streams.wire import codec
from trajbus.streams.wire.records import ReadyGroup, Step
from trajbus.streams.wire.versions import Segments, check_version_segments, token_versions


def cut_step(index: int = 0, prompt: list[int] | None = None, **kw) -> Step:
    """Five response tokens: two sampled by version 3, three by version 4 after a cut."""
    return Step(prompt_ids=prompt or [1, 2], response_ids=[10, 11, 12, 13, 14], trajectory_uid="t", prompt_uid="p",
                step_index=index, policy_version=3, rollout_log_probs=[-0.1, -0.2, -0.3, -0.4, -0.5],
                version_segments=[[0, 3], [2, 4]], **kw)


def test_token_versions_expand_runs_and_default_to_the_step_version():
    assert token_versions([[0, 3], [2, 4], [4, 6]], 5, 3).tolist() == [3, 3, 4, 4, 6]
    assert token_versions(None, 3, 7).tolist() == [7, 7, 7]
    assert token_versions(None, 0, 7).tolist() == []


@pytest.mark.parametrize("segments, problem", [
    ([], "non-empty"), ([[1, 3]], "starts at token 0"), ([[0, 3], [0, 4]], "increase"),
    ([[0, 3], [5, 4]], "within the 5"), ([[0, "3"]], "pair of integers"), ([[0, 3, 4]], "pair of integers"),
    ([[0, 2**63]], "64 bits"), ("0:3", "non-empty list"),
])
def test_bad_segments_are_named(segments, problem):
    with pytest.raises(ValueError, match=problem):
        check_version_segments(segments, 5)
    with pytest.raises(ValueError, match="version_segments"):
        Step(prompt_ids=[1], response_ids=[1] * 5, trajectory_uid="t", prompt_uid="p",
             version_segments=segments).validate()


def test_the_builder_writes_nothing_without_a_cut():
    plain = Segments()
    plain.add(4, 3)
    plain.add(2, 3)
    assert plain.wire(3) is None and plain.count == 6
    cut = Segments()
    cut.add(2, 3)
    cut.add(0, 4)  # a cut that sampled nothing before it adds no run
    cut.add(3, 4)
    assert cut.wire(3) == [[0, 3], [2, 4]]
    late = Segments()  # held at admission, the whole reply is the new version's
    late.add(5, 4)
    assert late.wire(3) == [[0, 4]]


def test_segments_survive_the_wire_and_cost_nothing_without_a_cut():
    step = cut_step()
    decoded = codec.decode(codec.encode(step))
    assert decoded.version_segments == [[0, 3], [2, 4]] and decoded.policy_version == 3
    plain = Step(prompt_ids=[1, 2], response_ids=[10, 11], trajectory_uid="t", prompt_uid="p", policy_version=3)
    with_segments = Step(**{**plain.__dict__, "version_segments": [[0, 3], [1, 4]]})
    assert codec.decode(codec.encode(plain)).version_segments is None
    assert len(codec.encode(with_segments)) - len(codec.encode(plain)) == 1 + 2 * (1 + 8)


def test_group_records_keep_each_steps_segments():
    first, second = cut_step(0), cut_step(1, prompt=[1, 2, 10, 11, 12, 13, 14, 5])
    second.version_segments = [[0, 4]]
    group = ReadyGroup(prompt_uid="p", channel="train", steps=[first, second], n_rollouts=1)
    ready = codec.decode(codec.encode(group))
    assert [s.version_segments for s in ready.steps] == [[[0, 3], [2, 4]], [[0, 4]]]
    structured = codec.decode(codec.encode(group), arrays=True, structured=True)
    assert [e.step.version_segments for e in structured.entries] == [[[0, 3], [2, 4]], [[0, 4]]]


def test_unknown_step_flags_are_refused():
    value = bytearray(codec.encode(cut_step()))
    flags_at = 4 + 2 + 1 + 2 + 4 + 8 + 8  # preamble, "t", "p", "", step_index, policy_version, reward
    value[flags_at] |= 0x80
    with pytest.raises(codec.DecodeError, match="unknown step flags 0x80"):
        codec.decode(bytes(value))


def test_trainer_tensors_carry_each_tokens_version_and_staleness():
    plain = Step(prompt_ids=[1], response_ids=[20, 21], trajectory_uid="u", prompt_uid="p", policy_version=2,
                 rollout_log_probs=[-0.1, -0.1])
    batch = VerlBackend(4, 6).convert([cut_step(), plain], current_version=5)
    assert batch.batch["token_policy_version"].tolist() == [[3, 3, 4, 4, 4, 3], [2, 2, 2, 2, 2, 2]]
    assert batch.batch["token_staleness"].tolist() == [[2, 2, 1, 1, 1, 0], [3, 3, 0, 0, 0, 0]]
    assert list(batch.non_tensor_batch["policy_version"]) == [3, 2]  # the version each call began with


def test_trajectory_rows_give_tokens_between_turns_the_next_steps_version():
    first = cut_step(0)
    second = Step(prompt_ids=[1, 2, 10, 11, 12, 13, 14, 7, 8], response_ids=[30], trajectory_uid="t",
                  prompt_uid="p", step_index=1, policy_version=4, rollout_log_probs=[-0.9], metadata={})
    for convert in (lambda b, s: b.convert(s), lambda b, s: b.convert_groups(
            [codec.decode(codec.encode(ReadyGroup("p", "train", s, 1)), structured=True)])):
        batch = convert(VerlBackend(4, 8, row_mode="trajectory"), [first, second])
        assert batch.batch["token_policy_version"].tolist() == [[3, 3, 4, 4, 4, 4, 4, 4]]
        assert batch.batch["response_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 1]]


def test_segment_level_weights_take_one_ratio_per_version_run():
    rollout = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    current = torch.log(torch.tensor([[0.5, 0.6, 0.5, 0.4]]))  # ratios 1.0, 1.2 | 1.0, 0.8
    versions = torch.tensor([[3, 3, 4, 4]])
    mask = torch.ones(1, 4, dtype=torch.long)
    weights, keep = importance_weights(rollout, current, mask, cap=2.0, level="segment", token_versions=versions)
    assert torch.allclose(weights, torch.tensor([[1.2, 1.2, 0.8, 0.8]]))
    assert keep.all()
    with pytest.raises(ValueError, match="token_versions"):
        importance_weights(rollout, current, mask, level="segment")


def test_tokens_staler_than_the_limit_are_masked():
    rollout = torch.full((1, 4), math.log(0.5))
    current = torch.full((1, 4), math.log(0.5))
    versions = torch.tensor([[3, 3, 4, 4]])
    weights, keep = importance_weights(rollout, current, torch.ones(1, 4), token_versions=versions,
                                       current_version=5, max_staleness=1)
    assert weights.tolist() == [[0.0, 0.0, 1.0, 1.0]] and keep.tolist() == [[False, False, True, True]]
