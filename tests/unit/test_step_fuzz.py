"""Fuzzing the Python API's record checks (issue 35, 5a): whatever a caller puts in a ``Step``, the check
refuses it with a ValueError or TypeError that names the field, or the step goes on the wire as a record
every reader decodes back (equal, in the wire's types: f64 numbers, f32 log-probs, lists, JSON metadata),
with a record timestamp Kafka can hold. The gateway refuses with the same rule and the same words."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trajbus.streams.client.producer import _as_step
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import PrefixEncoder
from trajbus.streams.wire.records import Step

FIELDS = {f.name for f in dataclasses.fields(Step)}
LIMIT = 2**63 // 1000  # the record's timestamp is int64 milliseconds
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

lone_surrogates = st.sampled_from(["\ud800", "p\udfff", "\udc80x"])
text = st.one_of(st.text(st.characters(exclude_categories=()), max_size=6), lone_surrogates)
big_int = st.integers(min_value=-(2**1100), max_value=2**1100)  # past a float's range
number = st.one_of(st.floats(), st.integers(), big_int)
scalar = st.one_of(st.none(), st.booleans(), number, text)
json_like = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.tuples(inner),
    st.dictionaries(st.one_of(text, st.integers(), st.booleans(), st.none()), inner, max_size=3)), max_leaves=8)
junk = st.one_of(scalar, st.lists(scalar, max_size=3), st.dictionaries(text, scalar, max_size=2),
                 st.binary(max_size=3), st.builds(object))


def _or_junk(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly values near the field's rule (its edges too), sometimes anything at all."""
    return st.one_of(valid, valid, valid, junk)


token_ids = st.lists(st.integers(min_value=-1, max_value=2**32), max_size=4)
FIELD_VALUES: dict[str, st.SearchStrategy] = {
    "prompt_ids": _or_junk(st.one_of(token_ids, token_ids.map(tuple))),
    "response_ids": _or_junk(token_ids),
    "trajectory_uid": _or_junk(text),
    "prompt_uid": _or_junk(text),
    "step_index": _or_junk(st.integers(min_value=-1, max_value=2**32)),
    "reward": _or_junk(number),
    "policy_version": _or_junk(st.integers(min_value=-(2**63) - 1, max_value=2**63)),
    "is_last": _or_junk(st.booleans()),
    "metadata": _or_junk(st.dictionaries(st.one_of(text, st.integers()), json_like, max_size=3)),
    "rollout_log_probs": _or_junk(st.one_of(st.none(), st.lists(number, max_size=4))),
    "created_at": _or_junk(st.one_of(number, st.sampled_from([LIMIT - 1, LIMIT, float(LIMIT), -0.0, -1e-9, 1e300]))),
    "channel": _or_junk(st.one_of(st.none(), st.sampled_from(["train", "val", "Bad!", ""]))),
    "n_rollouts": _or_junk(st.one_of(st.none(), st.integers(min_value=-1, max_value=2**32))),
    "version_segments": _or_junk(st.one_of(st.none(), st.lists(st.lists(st.integers(-1, 4), max_size=3), max_size=3))),
}


@st.composite
def valid_step_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Fields of a step that should pass: lengths that match, every number in its range."""
    response = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=5))  # a call samples a token at least
    fields = {
        "prompt_ids": draw(st.lists(st.integers(0, 2**32 - 1), max_size=5)), "response_ids": response,
        "trajectory_uid": draw(st.text(min_size=1, max_size=6)), "prompt_uid": draw(st.text(min_size=1, max_size=6)),
        "step_index": draw(st.integers(0, 2**32 - 1)), "reward": draw(st.floats(allow_nan=False, allow_infinity=False)),
        "policy_version": draw(st.integers(-(2**63), 2**63 - 1)), "is_last": draw(st.booleans()),
        "metadata": draw(st.dictionaries(st.text(max_size=4), st.recursive(
            st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                      st.text(max_size=4)),
            lambda inner: st.one_of(st.lists(inner, max_size=2), st.dictionaries(st.text(max_size=3), inner,
                                                                                 max_size=2)), max_leaves=5),
            max_size=3)),
        "created_at": draw(st.floats(min_value=0, max_value=float(LIMIT), exclude_max=True)),
        "channel": draw(st.sampled_from([None, "train", "a-b_1"])),
        "n_rollouts": draw(st.one_of(st.none(), st.integers(1, 2**32 - 1))),
    }
    if draw(st.booleans()):
        fields["rollout_log_probs"] = draw(st.lists(st.floats(allow_nan=False, width=32), min_size=len(response),
                                                    max_size=len(response)))
    if draw(st.booleans()):
        starts = sorted(draw(st.sets(st.integers(1, len(response) - 1), max_size=2))) if len(response) > 1 else []
        fields["version_segments"] = [[start, draw(st.integers(-(2**63), 2**63 - 1))] for start in [0, *starts]]
    return fields


@st.composite
def any_step_fields(draw: st.DrawFn) -> dict[str, Any]:
    """A valid step's fields with one to four of them drawn near or past their rule, or as anything at all."""
    fields = draw(valid_step_fields())
    for name in draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), min_size=1, max_size=4, unique=True)):
        fields[name] = draw(FIELD_VALUES[name])
    return fields


BASE = dict(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p")
KNOWN_BAD = [{**BASE, "trajectory_uid": "t\ud800"}, {**BASE, "metadata": {"k": "\udfff"}},
             {**BASE, "metadata": {1: "a", "1": "b"}}, {**BASE, "reward": 10**400}, {**BASE, "created_at": 1e300},
             {**BASE, "rollout_log_probs": [10**400]}, {**BASE, "trajectory_uid": ["t"]}]
"""Inputs the fuzzing found once (before issue 35's fix), always tried."""


def _known_bad(test: Callable[..., None]) -> Callable[..., None]:
    """Each of ``KNOWN_BAD`` as an explicit example of the fuzzed test."""
    for fields in KNOWN_BAD:
        test = example(fields)(test)
    return test


def _as_written(step: Step) -> Step:
    """The step a reader gets back: the wire's types (f64 numbers, f32 log-probs, lists, JSON metadata)."""
    log_probs = step.rollout_log_probs
    return dataclasses.replace(
        step, prompt_ids=list(step.prompt_ids), response_ids=list(step.response_ids), reward=float(step.reward),
        created_at=float(step.created_at), metadata=json.loads(json.dumps(step.metadata)),
        rollout_log_probs=None if log_probs is None else np.asarray(log_probs, dtype="<f4").tolist())


def _refused_naming_a_field(error: Exception) -> None:
    named = re.match(r"[a-z_]+", str(error))
    assert named is not None and named.group(0) in FIELDS, f"{type(error).__name__} names no field: {error}"


def _on_the_wire(step: Step) -> None:
    """What the producer writes decodes back equal, under a timestamp Kafka can hold."""
    assert 0 <= int(step.created_at * 1000) < 2**63
    assert codec.decode(codec.encode(step)) == _as_written(step)


@FUZZ
@given(any_step_fields())
@_known_bad
def test_a_step_is_refused_naming_the_field_or_decodes_back_equal(fields: dict[str, Any]):
    step = Step(**fields)
    try:
        step.validate()
    except (ValueError, TypeError) as error:
        _refused_naming_a_field(error)
        return
    _on_the_wire(step)


@FUZZ
@given(any_step_fields())
@_known_bad
def test_submit_steps_checks_a_dict_or_a_step_as_validate_does(fields: dict[str, Any]):
    """``submit_steps``' own coercion (``_as_step``, all before any record is produced), for both forms."""
    for given_as in (dict(fields), Step(**fields)):
        encoder = PrefixEncoder()
        try:
            step = _as_step(given_as, "train", None, encoder)
        except (ValueError, TypeError) as error:
            if isinstance(given_as, dict) or not str(error).startswith("channel: step "):  # a channel mismatch
                _refused_naming_a_field(error)
            continue
        assert codec.decode(codec.encode(encoder.delta(step))) == _as_written(step)
        _on_the_wire(step)


@FUZZ
@given(any_step_fields(), st.sets(st.sampled_from(Step.REQUIRED), min_size=1))
def test_a_step_constructed_without_a_required_field_is_refused_naming_it(fields: dict[str, Any], left_out: set):
    with pytest.raises(TypeError) as error:
        Step(**{name: value for name, value in fields.items() if name not in left_out})
    _refused_naming_a_field(error.value)
    assert str(error.value).split(":")[0] in left_out and str(error.value).endswith(": required field is missing")


@FUZZ
@given(valid_step_fields())
def test_every_valid_step_decodes_back_equal(fields: dict[str, Any]):
    _on_the_wire(Step(**fields).validate())


@pytest.mark.parametrize("created_at", [LIMIT, 2.0**63, 1e300, -1.0, 10**400])
def test_a_created_at_past_the_record_timestamp_is_refused_as_the_gateway_refuses_it(created_at):
    from trajbus.gateway.schemas import step_from_json

    fields = dict(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p", created_at=created_at)
    with pytest.raises(ValueError, match=r"^created_at: ") as api:
        Step(**fields).validate()
    with pytest.raises(ValueError) as gateway:
        step_from_json(fields)
    assert str(api.value) == str(gateway.value)


@pytest.mark.parametrize("field, value", [("metadata", {"k": "\ud800"}), ("metadata", {"\udfff": 1}),
                                          ("metadata", {"k": ["x", {"y": "a\udc80"}]}),
                                          ("trajectory_uid", "t\ud800"), ("prompt_uid", "\udfff")])
def test_a_lone_surrogate_is_refused_as_the_gateway_refuses_it(field, value):
    from trajbus.gateway.state.lifecycle import checked_metadata

    fields = {**dict(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p"), field: value}
    with pytest.raises(ValueError, match=f"^{field}: .*lone surrogate") as api:
        Step(**fields).validate()
    if field == "metadata":
        with pytest.raises(Exception) as gateway:
            checked_metadata(value)
        assert gateway.value.message == str(api.value)  # a 400 with the same words


def test_metadata_keys_that_json_would_turn_into_strings_are_refused():
    """``{1: "a", "1": "b"}`` would reach a reader as one key: a record that does not decode back."""
    with pytest.raises(ValueError, match="^metadata: keys must be strings"):
        Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p",
             metadata={"x": {1: "a", "1": "b"}}).validate()
