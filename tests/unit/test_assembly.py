"""Group assembly rules, on their own (the worker applies exactly these), against a plain list as the log."""

from __future__ import annotations

from trajbus.streams.worker.assembly import EventEffect, PendingGroup
from trajbus.streams.wire.records import END_STEPS, Step, TrajectoryEnd


class Log:
    """A steps partition: events get consecutive offsets; the group keeps offsets, the log the bodies."""

    def __init__(self, group: PendingGroup) -> None:
        self.group = group
        self.records: list[Step | TrajectoryEnd] = []

    def add(self, event: Step | TrajectoryEnd, default_n_rollouts: int) -> EventEffect:
        self.records.append(event)
        return self.group.add(event, len(self.records) - 1, default_n_rollouts)

    def ready(self, default_n_rollouts: int):
        return self.group.to_ready_group(dict(enumerate(self.records)), default_n_rollouts)[0]


def step(traj: str, index: int, last: bool = False, reward: float = 0.0, n_rollouts=None) -> Step:
    return Step(prompt_ids=[1], response_ids=[2, index], trajectory_uid=traj, prompt_uid="p", step_index=index,
                is_last=last, reward=reward, n_rollouts=n_rollouts)


def test_ready_after_n_complete_trajectories_sorted_by_trajectory_and_step():
    group = PendingGroup("p", "train")
    log = Log(group)
    events = [step("b", 0), step("a", 0), step("b", 1, last=True, reward=1.0), step("a", 1, last=True)]
    outcomes = [log.add(e, default_n_rollouts=2) for e in events]
    assert outcomes == [EventEffect.ACCEPTED] * 3 + [EventEffect.READY]
    ready = log.ready(2)
    assert [(s.trajectory_uid, s.step_index) for s in ready.steps] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert ready.n_rollouts == 2 and ready.status == "complete"


def test_duplicate_step_counts_once():
    group = PendingGroup("p", "train")
    log = Log(group)
    assert log.add(step("a", 0), 1) is EventEffect.ACCEPTED
    assert log.add(step("a", 0), 1) is EventEffect.DUPLICATE
    assert group.offsets() == [0]


def test_last_step_before_a_missing_earlier_step_waits_for_it():
    group = PendingGroup("p", "train")
    log = Log(group)
    assert log.add(step("a", 1, last=True), 1) is EventEffect.ACCEPTED
    assert log.add(step("a", 0), 1) is EventEffect.READY


def test_trajectory_end_completes_and_puts_reward_on_last_step():
    group = PendingGroup("p", "train")
    log = Log(group)
    log.add(step("a", 0), 1)
    log.add(step("a", 1), 1)
    end = TrajectoryEnd(trajectory_uid="a", prompt_uid="p", reward=0.75)
    assert log.add(end, 1) is EventEffect.READY
    ready = log.ready(1)
    assert [s.reward for s in ready.steps] == [0.0, 0.75]
    assert [s.is_last for s in ready.steps] == [False, True]


def test_trajectory_end_for_unknown_trajectory():
    group = PendingGroup("p", "train")
    log = Log(group)
    assert log.add(TrajectoryEnd(trajectory_uid="x", prompt_uid="p"), 1) is EventEffect.UNKNOWN_TRAJECTORY


def test_registered_size_overrides_default():
    group = PendingGroup("p", "train")
    log = Log(group)
    assert log.add(step("a", 0, last=True, n_rollouts=1), default_n_rollouts=4) is EventEffect.READY


def test_pending_state_survives_its_encoding():
    group = PendingGroup("p", "train", n_rollouts=3)
    log = Log(group)
    log.add(step("a", 0), 3)
    log.add(step("a", 1), 3)
    log.add(TrajectoryEnd(trajectory_uid="a", prompt_uid="p", reward=2.0), 3)
    log.add(step("b", 1), 3)
    log.add(TrajectoryEnd(trajectory_uid="b", prompt_uid="p", metadata={END_STEPS: [1]}), 3)
    restored = PendingGroup.decode(group.encode())
    assert restored == group
    assert len(group.encode()) < 400, "the index of a group, not its tokens"


def named_end(traj: str, steps: list[int], reward: float | None = 1.0) -> TrajectoryEnd:
    return TrajectoryEnd(trajectory_uid=traj, prompt_uid="p", reward=reward, metadata={END_STEPS: steps})


def test_an_end_naming_its_steps_makes_the_trajectory_exactly_those():
    group = PendingGroup("p", "train")
    log = Log(group)
    for index in (0, 1, 2):  # 1 was sent but never acknowledged: its end leaves it out
        log.add(step("a", index), 1)
    assert log.add(named_end("a", [2, 0], reward=0.5), 1) is EventEffect.READY
    ready = log.ready(1)
    assert [(s.step_index, s.is_last, s.reward) for s in ready.steps] == [(0, False, 0.0), (2, True, 0.5)]


def test_a_named_index_is_waited_for_and_an_unused_one_is_not():
    group = PendingGroup("p", "train")
    log = Log(group)
    log.add(step("a", 1), 1)  # index 0 was taken by a call whose record never arrived
    assert log.add(named_end("a", [1, 3]), 1) is EventEffect.ACCEPTED
    assert group.complete_trajectories() == []
    assert log.add(step("a", 3), 1) is EventEffect.READY
    assert [s.step_index for s in log.ready(1).steps] == [1, 3]


def test_an_unnamed_step_arriving_after_the_end_stays_out():
    group = PendingGroup("p", "train")
    log = Log(group)
    log.add(step("a", 0), 2)
    log.add(named_end("a", [0]), 2)
    log.add(step("a", 1), 2)  # delivered late, after the gateway gave up on it
    log.add(step("b", 0, last=True), 2)
    assert group.complete_trajectories() == ["a", "b"]
    assert [(s.trajectory_uid, s.step_index) for s in log.ready(2).steps] == [("a", 0), ("b", 0)]
