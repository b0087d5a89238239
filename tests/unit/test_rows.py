"""Rows straight from a group record's prefix structure equal the rows of its full steps, in both modes."""

from __future__ import annotations

import random

import pytest
import torch

from trajbus.consumers.backends import VerlBackend
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import PROMPT_EXTENDS_STEP, PrefixError, StepDelta, StructuredGroup
from trajbus.streams.wire.records import CONTINUES, SEGMENT_START, ReadyGroup, Step
from tests.unit.test_prefix import trajectory


def structured(steps: list[Step]) -> StructuredGroup:
    """As a trainer decodes a group record: prompts not rebuilt, token ids numpy views of the value."""
    return codec.decode(codec.encode(ReadyGroup("p", "train", steps, 1)), arrays=True, structured=True)


def same_batches(steps: list[Step], row_mode: str, prompt_length: int = 4096, response_length: int = 4096) -> None:
    backend = VerlBackend(prompt_length, response_length, row_mode=row_mode)
    ordered = sorted(steps, key=lambda s: s.key)
    expected, got = backend.convert(ordered, current_version=3), backend.convert_groups([structured(steps)], 3)
    assert set(got.batch.keys()) == set(expected.batch.keys())
    for key in expected.batch.keys():
        assert torch.equal(got.batch[key], expected.batch[key]), key
    for key, values in expected.non_tensor_batch.items():
        assert list(got.non_tensor_batch[key]) == list(values), key
    assert got.meta_info == expected.meta_info


@pytest.mark.parametrize("row_mode", ["step", "trajectory"])
def test_multi_turn_rollouts_sharing_a_task(row_mode):
    rng = random.Random(3)
    steps = []
    for r in range(4):
        rollout = trajectory(f"t{r}", 6, response=rng.randrange(5, 40), tool=rng.randrange(1, 30))
        for step in rollout:
            step.rollout_log_probs = [-rng.random() for _ in step.response_ids]
        rollout[-1].reward = float(r)
        steps += rollout
    same_batches(steps, row_mode)


@pytest.mark.parametrize("row_mode", ["step", "trajectory"])
def test_segment_starts_continued_choices_and_a_rewritten_history(row_mode):
    def step(index: int, prompt: list[int], response: list[int], **metadata) -> Step:
        return Step(prompt_ids=prompt, response_ids=response, trajectory_uid="a", prompt_uid="p", step_index=index,
                    rollout_log_probs=[-0.5] * len(response), metadata=metadata)

    steps = [
        step(0, [11], [21]),
        step(1, [11, 21, 31], [22]),
        step(2, [11, 21, 31], [23], **{SEGMENT_START: True}),  # stored against step 1's prompt: compared
        step(3, [11, 21, 31, 22, 32], [24], **{CONTINUES: 1}),
        step(4, [40], [41], **{SEGMENT_START: True}),  # the agent started over: a full prompt
        step(5, [40, 41, 50], [51]),
        step(6, [11, 21, 31, 22, 32, 24, 60], [61], **{SEGMENT_START: True}),  # extends step 3, stored vs step 5
    ]
    same_batches(steps, row_mode)


def test_a_step_that_does_not_extend_the_one_it_continues_is_refused_as_from_full_steps():
    steps = trajectory("t", 3)
    steps[2].prompt_ids = steps[2].prompt_ids[:5] + [7] + steps[2].prompt_ids[6:]  # history edited, unmarked
    backend = VerlBackend(4096, 4096, row_mode="trajectory")
    with pytest.raises(ValueError, match="t#2: its prompt does not extend") as from_steps:
        backend.convert(steps)
    with pytest.raises(ValueError, match="t#2: its prompt does not extend") as from_structure:
        backend.convert_groups([structured(steps)])
    assert str(from_structure.value) == str(from_steps.value)


def test_a_trajectory_row_reads_only_the_stored_tokens_of_extending_steps():
    steps = trajectory("t", 8, response=30, tool=20)
    group = structured(steps)
    assert all(e.kind == PROMPT_EXTENDS_STEP and e.base_index == e.step.step_index - 1 for e in group.entries[1:])
    [row] = VerlBackend(4096, 4096, row_mode="trajectory").structured_rows([group])
    assert len(row.response) == sum(len(e.step.prompt_ids) for e in group.entries[1:]) + 8 * 30
    assert row.prompt.tolist() == steps[0].prompt_ids
    assert row.prompt.tolist() + row.response.tolist() == steps[-1].prompt_ids + steps[-1].response_ids


def test_a_group_record_whose_prefix_lies_outside_its_base_does_not_decode():
    steps = trajectory("t", 2)
    group = structured(steps)
    bad = StepDelta(group.entries[1].step, PROMPT_EXTENDS_STEP, prefix_len=10_000, base_index=0)
    with pytest.raises(PrefixError, match="t#1: its prefix is not in the group"):
        StructuredGroup(group.shared, [group.entries[0], bad], group.fields).check()
