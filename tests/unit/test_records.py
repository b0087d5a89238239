"""Record validation: bad input is refused with a ValueError that names the field."""

from __future__ import annotations

from array import array

import pytest

from trajbus.streams.wire.records import Step, TrajectoryEnd

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
    ("rollout_log_probs", array("d", [-0.1, -0.2]), "^rollout_log_probs: has 2 values for 1"),  # the gateway's kind
    ("rollout_log_probs", array("d", [float("nan")]), r"^rollout_log_probs\[0\]: must be a number, got nan"),
    ("rollout_log_probs", array("f", [-0.1]), "^rollout_log_probs: must be a list of floats"),
    ("response_ids", array("i", [3]), "^response_ids: must be a list of token ids, got array"),  # signed: not ids
    ("channel", "Train!", "^channel: "),
    ("n_rollouts", 0, "^n_rollouts: "),
])
def test_invalid_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        Step.from_dict({**VALID, field: value})


@pytest.mark.parametrize("record, missing", [(Step, name) for name in Step.REQUIRED] +
                         [(TrajectoryEnd, name) for name in TrajectoryEnd.REQUIRED])
def test_a_constructor_call_without_a_required_field_names_it_as_from_dict_does(record, missing):
    given = {k: v for k, v in {**VALID, "reward": 1.0}.items() if k != missing and k in record.__dataclass_fields__}
    with pytest.raises(TypeError, match=f"^{missing}: required field is missing$") as constructed:
        record(**given)
    with pytest.raises(ValueError) as from_dict:
        record.from_dict(given)
    assert str(constructed.value) == str(from_dict.value)


def test_a_positional_call_short_of_a_field_names_the_first_one_missing():
    with pytest.raises(TypeError, match="^prompt_uid: required field is missing$"):
        Step([1, 2], [3], "t")


def test_an_empty_response_is_refused_by_the_api_and_the_gateway_in_the_same_words():
    from trajbus.gateway.schemas import step_from_json

    for empty in ([], ()):
        with pytest.raises(ValueError, match=r"^response_ids: must hold at least one token id") as api:
            Step(**{**VALID, "response_ids": empty}).validate()
    with pytest.raises(ValueError) as gateway:
        step_from_json({**VALID, "response_ids": []})
    assert str(gateway.value) == str(api.value).replace("()", "[]")


def test_the_gateways_packed_response_and_log_probs_are_a_valid_step():
    step = Step.from_dict({**VALID, "response_ids": array("I", [3, 4]),
                           "rollout_log_probs": array("d", [-0.5, float("-inf")])})  # -inf: a token held impossible
    assert list(step.response_ids) == [3, 4]


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
