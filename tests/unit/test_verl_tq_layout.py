"""A ready group in verl V1's TransferQueue layout: the rows ``VerlBackend`` pads, unpadded, under verl's keys."""

from __future__ import annotations

import torch

from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.verl.transfer_queue import group_records
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import StructuredGroup
from trajbus.streams.wire.records import ReadyGroup, Step

SESSION = "session"


def two_turns(trajectory: str, session: int, version: int, reward: float) -> list[Step]:
    """A tool-calling trajectory: the model's call, the tool's answer in the second prompt, the final answer
    cut by a weight update (its last token sampled by ``version + 1``)."""
    first = Step(prompt_ids=[1, 2, 3], response_ids=[10, 11], trajectory_uid=trajectory, prompt_uid="p",
                 step_index=0, policy_version=version, rollout_log_probs=[-0.1, -0.2], metadata={SESSION: session})
    second = Step(prompt_ids=[1, 2, 3, 10, 11, 50, 51], response_ids=[12, 13, 14], trajectory_uid=trajectory,
                  prompt_uid="p", step_index=1, policy_version=version, rollout_log_probs=[-0.3, -0.4, -0.5],
                  reward=reward, is_last=True, metadata={SESSION: session}, version_segments=[[0, version],
                                                                                              [2, version + 1]])
    return [first, second]


def structured(steps: list[Step]) -> StructuredGroup:
    return codec.decode(codec.encode(ReadyGroup("p", "train", steps, 2)), arrays=True, structured=True)


def test_each_trajectory_is_one_record_under_its_session_with_verls_fields_and_tags():
    steps = two_turns("a", 1, 4, 1.0) + two_turns("b", 0, 5, 0.0)  # "a" comes first: the session names the key
    prompt = {"uid": "u1", "index": 7, "global_steps": 6, "data_source": "calc"}
    records = group_records(structured(steps), "u1", prompt, SESSION)

    assert records.keys == ["u1_1_0", "u1_0_0"]
    b = records.fields[0]
    assert b["prompts"].tolist() == [1, 2, 3]
    assert b["responses"].tolist() == [10, 11, 50, 51, 12, 13, 14]
    assert b["response_mask"].tolist() == [1, 1, 0, 0, 1, 1, 1]
    assert torch.equal(b["loss_mask"], b["response_mask"])
    assert b["rollout_log_probs"].tolist() == torch.tensor([-0.1, -0.2, 0, 0, -0.3, -0.4, -0.5]).tolist()
    assert b["rm_scores"].tolist() == [0, 0, 0, 0, 0, 0, 1.0]
    assert b["input_ids"].tolist() == [1, 2, 3, 10, 11, 50, 51, 12, 13, 14]
    assert b["position_ids"].tolist() == list(range(10))
    assert b["token_policy_version"].tolist() == [4, 4, 4, 4, 4, 4, 5]
    assert (b["uid"], b["index"], b["global_steps"], b["data_source"], b["session_id"]) == ("u1", 7, 6, "calc", 1)
    assert b["extra_fields"]["min_global_steps"] == 4 and b["extra_fields"]["max_global_steps"] == 5
    assert b["extra_fields"]["trajectory_uid"] == "a"
    assert records.tags[0] == {"status": "success", "prompt_len": 3, "response_len": 7, "seq_len": 10,
                               "global_steps": 6, "min_global_steps": 4, "max_global_steps": 5}
    assert records.tags[1]["min_global_steps"] == 5


def test_the_records_hold_the_tensors_verl_backend_pads():
    steps = two_turns("a", 0, 1, 0.5) + two_turns("b", 1, 1, 1.0)
    records = group_records(structured(steps), "u", {"global_steps": 2}, SESSION)
    padded = VerlBackend(8, 8, row_mode="trajectory").convert_groups([structured(steps)])
    for row, fields in enumerate(records.fields):
        p, r = len(fields["prompts"]), len(fields["responses"])
        assert padded.batch["prompts"][row, 8 - p:].tolist() == fields["prompts"].tolist()
        for key in ("responses", "response_mask", "rollout_log_probs", "rm_scores"):
            assert padded.batch[key][row, :r].tolist() == fields[key].tolist(), key


def test_without_a_session_in_the_metadata_trajectories_take_their_order():
    steps = two_turns("a", 0, 0, 0.0) + two_turns("b", 1, 0, 0.0)
    for step in steps:
        step.metadata.clear()
    assert group_records(structured(steps), "u", {}, SESSION).keys == ["u_0_0", "u_1_0"]
