"""The trained log's record and its rewind rule (``streams.wire.trained``)."""

from __future__ import annotations

import pytest

from trajbus.streams.wire.trained import (GroupRef, TrainedLogError, TrainedStep, decode_trained, effective_steps,
                                          encode_trained)


def step(n: int, *uids: str, run: str = "r", rank: int = 0) -> TrainedStep:
    return TrainedStep(run, n, "t.groups.train", [GroupRef(0, i, uid) for i, uid in enumerate(uids)], {0: len(uids)},
                       policy_version=n - 1, rank=rank)


def test_a_record_round_trips_with_its_groups_in_order_and_its_positions():
    record = TrainedStep("run-a", 7, "t.groups.train", [GroupRef(3, 41, "p-b"), GroupRef(1, 9, "p-a")], {1: 10, 3: 42},
                         trainer="verl", policy_version=6, rank=2, at=1.5)
    key, value = encode_trained(record)
    assert key == b"run-a"
    assert decode_trained(value) == record


@pytest.mark.parametrize("value, problem", [(b"{not json", "JSONDecodeError"), (b'{"run": "r"}', "KeyError"),
                                            (b'{"run": "r", "step": "1", "topic": "t", "groups": [], "positions": {}}',
                                             "step must be an integer")])
def test_a_bad_record_is_refused_naming_the_problem(value, problem):
    with pytest.raises(TrainedLogError, match=problem):
        decode_trained(value)


def test_a_resume_supersedes_the_steps_after_its_checkpoint():
    log = [step(1, "a"), step(2, "b"), step(3, "c"), step(4, "d"),  # checkpoint at 2, crash after 4
           step(3, "c"), step(4, "d"), step(5, "e")]
    assert [(s.step, [g.prompt_uid for g in s.groups]) for s in effective_steps(log)] == [
        (1, ["a"]), (2, ["b"]), (3, ["c"]), (4, ["d"]), (5, ["e"])]


def test_runs_and_ranks_rewind_apart():
    log = [step(1, "a"), step(1, "x", rank=1), step(2, "b"), step(1, "y", run="other"), step(2, "z", rank=1),
           step(2, "b2")]
    assert [(s.run, s.step, s.rank, [g.prompt_uid for g in s.groups]) for s in effective_steps(log)] == [
        ("other", 1, 0, ["y"]), ("r", 1, 0, ["a"]), ("r", 1, 1, ["x"]), ("r", 2, 0, ["b2"]), ("r", 2, 1, ["z"])]
