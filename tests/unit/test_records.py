"""Record validation: bad input is refused with a ValueError that names the field."""

from __future__ import annotations

import pytest

from trajbus.streams.records import Step, TrajectoryEnd

VALID = dict(prompt_ids=[1, 2], response_ids=[3], trajectory_uid="t", prompt_uid="p")


@pytest.mark.parametrize("missing", ["prompt_ids", "response_ids", "trajectory_uid", "prompt_uid"])
def test_missing_required_field_is_named(missing):
    data = {k: v for k, v in VALID.items() if k != missing}
    with pytest.raises(ValueError, match=f"^{missing}: required field is missing"):
        Step.from_dict(data)


@pytest.mark.parametrize("field, value, match", [
    ("step_index", -1, "^step_index: "),
    ("step_index", 1.0, "^step_index: "),
    ("prompt_ids", [1, 2.0], r"^prompt_ids\[1\]: "),
    ("prompt_ids", [1, "2"], r"^prompt_ids\[1\]: "),
    ("response_ids", [True], r"^response_ids\[0\]: "),
    ("response_ids", [-5], r"^response_ids\[0\]: "),
    ("response_ids", "abc", "^response_ids: "),
    ("trajectory_uid", "", "^trajectory_uid: "),
    ("prompt_uid", 5, "^prompt_uid: "),
    ("reward", float("nan"), "^reward: "),
    ("reward", "1", "^reward: "),
    ("is_last", 1, "^is_last: "),
    ("metadata", {"x": object()}, "^metadata: "),
    ("metadata", [], "^metadata: "),
    ("rollout_log_probs", [-0.1, -0.2], "^rollout_log_probs: has 2 values for 1"),
    ("channel", "Train!", "^channel: "),
    ("n_rollouts", 0, "^n_rollouts: "),
])
def test_invalid_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        Step.from_dict({**VALID, field: value})


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="^colour: unknown field of Step"):
        Step.from_dict({**VALID, "colour": "red"})


def test_valid_step_from_dict():
    step = Step.from_dict({**VALID, "step_index": 3, "rollout_log_probs": [-0.5]})
    assert step.key == ("t", 3)
    assert step.created_at > 0


def test_trajectory_end_validation():
    with pytest.raises(ValueError, match="^reward: "):
        TrajectoryEnd(trajectory_uid="t", prompt_uid="p", reward=float("inf")).validate()
    with pytest.raises(ValueError, match="^prompt_uid: required"):
        TrajectoryEnd.from_dict({"trajectory_uid": "t"})


@pytest.mark.parametrize("steps", [[], [0, 0], [-1], [True], "0,1", [1.0]])
def test_an_end_naming_its_steps_names_distinct_indices(steps):
    with pytest.raises(ValueError, match=r"^metadata\.steps: "):
        TrajectoryEnd(trajectory_uid="t", prompt_uid="p", metadata={"steps": steps}).validate()
    assert TrajectoryEnd(trajectory_uid="t", prompt_uid="p", metadata={"steps": [2, 0]}).validate().steps == [2, 0]
