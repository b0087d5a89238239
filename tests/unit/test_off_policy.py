"""Off-policy bookkeeping: staleness per row and truncated importance weights, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.off_policy import importance_weights
from trajbus.streams.wire.records import Step


def test_rows_carry_staleness_against_the_current_version():
    steps = [Step(prompt_ids=[1], response_ids=[2], trajectory_uid=f"t{v}", prompt_uid="p", policy_version=v)
             for v in (3, 5)]
    batch = VerlBackend(2, 2).convert(steps, current_version=6)
    assert list(batch.non_tensor_batch["staleness"]) == [3, 1]
    assert batch.meta_info["current_policy_version"] == 6


def test_token_level_weights_are_truncated_and_masked():
    rollout = torch.tensor([[math.log(0.5), math.log(0.5), math.log(0.5)]])
    current = torch.tensor([[math.log(0.5), math.log(0.75), math.log(0.2)]])  # ratios 1.0, 1.5, 0.4
    mask = torch.tensor([[1, 1, 0]])
    weights, keep = importance_weights(rollout, current, mask, cap=1.2)
    assert torch.allclose(weights, torch.tensor([[1.0, 1.2, 0.0]]))  # 1.5 truncated to the cap; padding 0
    assert keep.tolist() == [[True, False, False]]  # 1.5 is outside [1/1.2, 1.2]


def test_sequence_level_uses_one_ratio_per_row():
    rollout = torch.zeros(2, 2)
    current = torch.tensor([[0.1, 0.2], [-0.05, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    weights, keep = importance_weights(rollout, current, mask, cap=2.0, level="sequence")
    assert torch.allclose(weights[0], torch.full((2,), math.exp(0.3)))
    assert torch.allclose(weights[1], torch.tensor([math.exp(-0.05), 0.0]))
    assert keep.tolist() == [[True, True], [True, False]]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="level"):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), level="word")
    with pytest.raises(ValueError, match="shapes differ"):
        importance_weights(torch.zeros(1, 2), torch.zeros(1, 1), torch.ones(1, 1))
