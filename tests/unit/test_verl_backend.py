"""VerlBackend: every tensor of a small batch against values written out by hand, and verl's GRPO on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trajbus.consumers.backends import VerlBackend
from trajbus.streams.wire.records import CONTINUES, SEGMENT_START, Step


def step(traj: str, index: int, prompt: list[int], response: list[int], reward: float = 0.0,
         log_probs: list[float] | None = None, uid: str = "p", **kw) -> Step:
    return Step(prompt_ids=prompt, response_ids=response, trajectory_uid=traj, prompt_uid=uid, step_index=index,
                reward=reward, rollout_log_probs=log_probs, **kw)


def test_step_rows_layout_by_hand():
    steps = [
        step("a", 0, [11, 12], [21, 22, 23], reward=1.0, log_probs=[-0.1, -0.2, -0.3], policy_version=3,
             metadata={"env": "math"}),
        step("b", 0, [13, 14, 15], [24], reward=0.5, log_probs=[-0.4], policy_version=2),
    ]
    batch = VerlBackend(prompt_length=4, response_length=3, pad_token_id=0).convert(steps)
    t = batch.batch
    assert t["prompts"].tolist() == [[0, 0, 11, 12], [0, 13, 14, 15]]
    assert t["responses"].tolist() == [[21, 22, 23], [24, 0, 0]]
    assert t["input_ids"].tolist() == [[0, 0, 11, 12, 21, 22, 23], [0, 13, 14, 15, 24, 0, 0]]
    assert t["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0]]
    assert t["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert t["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 3, 3]]
    assert t["rm_scores"].dtype == torch.float32
    assert t["rm_scores"].tolist() == [[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]]
    assert t["rollout_log_probs"].dtype == torch.float32
    assert np.allclose(t["rollout_log_probs"].numpy(), [[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]])
    nt = batch.non_tensor_batch
    assert list(nt["uid"]) == ["p", "p"] and list(nt["trajectory_uid"]) == ["a", "b"]
    assert list(nt["policy_version"]) == [3, 2] and list(nt["env"]) == ["math", None]
    assert batch.meta_info["temperature"] == 1.0 and batch.meta_info["num_tokens"] == 9


def test_trajectory_rows_join_turns_and_mask_what_the_model_did_not_say():
    # Turn 2's prompt = turn 1's prompt + response + a tool result [31, 32].
    steps = [
        step("a", 1, [11, 21, 22, 31, 32], [23], reward=2.0, log_probs=[-0.5]),
        step("a", 0, [11], [21, 22], log_probs=[-0.1, -0.2]),
    ]
    batch = VerlBackend(prompt_length=2, response_length=6, row_mode="trajectory").convert(steps)
    t = batch.batch
    assert t["prompts"].tolist() == [[0, 11]]
    assert t["responses"].tolist() == [[21, 22, 31, 32, 23, 0]]
    assert t["response_mask"].tolist() == [[1, 1, 0, 0, 1, 0]]
    assert t["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1, 0]]
    assert t["rm_scores"].tolist() == [[0, 0, 0, 0, 2.0, 0]]
    assert np.allclose(t["rollout_log_probs"].numpy(), [[-0.1, -0.2, 0, 0, -0.5, 0]])
    assert list(batch.non_tensor_batch["step_index"]) == [1]


def test_trajectory_rows_split_at_segment_starts_and_follow_what_a_step_continues():
    steps = [
        step("a", 0, [11], [21]),
        step("a", 1, [11, 21, 31], [22]),  # an n=2 call: choice 0 continues the conversation...
        step("a", 2, [11, 21, 31], [23], metadata={SEGMENT_START: True}),  # ...choice 1 is a row of its own
        step("a", 3, [11, 21, 31, 22, 32], [24], metadata={CONTINUES: 1}),
        step("a", 4, [40], [41], reward=1.0, metadata={SEGMENT_START: True}),  # the agent started over
    ]
    rows = VerlBackend(prompt_length=4, response_length=6, row_mode="trajectory").rows(steps)
    assert [(r.prompt, r.response, r.response_mask) for r in rows] == [
        ([11], [21, 31, 22, 32, 24], [1, 0, 1, 0, 1]), ([11, 21, 31], [23], [1]), ([40], [41], [1])]
    assert [[s.step_index for s in r.steps] for r in rows] == [[0, 1, 3], [2], [4]]
    assert [r.reward for r in rows] == [1.0, 1.0, 1.0]


def test_log_probs_only_when_every_step_has_them():
    steps = [step("a", 0, [1], [2], log_probs=[-1.0]), step("b", 0, [1], [3])]
    assert "rollout_log_probs" not in VerlBackend(2, 2).convert(steps).batch.keys()


@pytest.mark.parametrize("steps, backend, match", [
    ([step("a", 0, [1, 2, 3], [4])], VerlBackend(2, 4), "step a#0: prompt of 3 tokens exceeds prompt_length 2"),
    ([step("a", 0, [1], [4, 5, 6])], VerlBackend(2, 2), "step a#0: response of 3 tokens exceeds response_length 2"),
    ([step("a", 0, [1], [2]), step("a", 1, [9, 9], [3])], VerlBackend(4, 4, row_mode="trajectory"),
     "step a#1: its prompt does not extend"),
    ([], VerlBackend(2, 2), "empty batch"),
    ([step("a", 0, [1], [2]), step("a", 2, [1, 2], [3], metadata={CONTINUES: 1})],
     VerlBackend(4, 4, row_mode="trajectory"), "step a#2: the step it continues is not in the batch"),
    ([step("a", 0, [1], [2]), step("a", 1, [1, 2], [3], uid="q")], VerlBackend(4, 4, row_mode="trajectory"),
     "step a#1: prompt_uid 'q' differs from its group's 'p'"),
])
def test_bad_batches_name_the_step(steps, backend, match):
    with pytest.raises(ValueError, match=match):
        backend.convert(steps)


def test_verl_grpo_advantages_and_policy_loss_on_a_converted_group():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn

    rewards = [1.0, 0.0, 0.0, 1.0]
    steps = [step(f"t{i}", 0, [5, 6], [7, 8, 9][: 1 + i % 3], reward=r, log_probs=[-0.7] * (1 + i % 3))
             for i, r in enumerate(rewards)]
    batch = VerlBackend(prompt_length=2, response_length=3).convert(steps)
    advantages, _returns = compute_grpo_outcome_advantage(
        token_level_rewards=batch.batch["rm_scores"], response_mask=batch.batch["response_mask"],
        index=batch.non_tensor_batch["uid"])
    scores = torch.tensor(rewards)
    expected = (scores - scores.mean()) / (scores.std() + 1e-6)  # GRPO by hand: one group, unbiased std
    mask = batch.batch["response_mask"].bool()
    for row in range(4):
        assert torch.allclose(advantages[row][mask[row]], expected[row].expand(int(mask[row].sum())), atol=1e-5)
        assert torch.all(advantages[row][~mask[row]] == 0)

    from omegaconf import OmegaConf

    old = batch.batch["rollout_log_probs"]
    n_tokens = int(batch.batch["response_mask"].sum())
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                               "global_batch_info": {"dp_size": 1, "batch_num_tokens": n_tokens,
                                                     "global_batch_size": 4}})
    loss, _metrics = get_policy_loss_fn("vanilla")(
        old_log_prob=old, log_prob=old.clone(), advantages=advantages, response_mask=batch.batch["response_mask"],
        loss_agg_mode="token-mean", config=config)
    # Same policy as the rollout: ratio 1, so the loss is minus the mean advantage over response tokens.
    assert torch.allclose(loss, -(advantages[mask]).mean(), atol=1e-5)


def test_a_group_with_two_prompt_uids_is_refused_naming_the_step():
    from trajbus.consumers.rows import check_group

    with pytest.raises(ValueError, match="step b#0: prompt_uid 'q' differs from its group's 'p'"):
        check_group([step("a", 0, [1], [2]), step("b", 0, [1], [2], uid="q")])
