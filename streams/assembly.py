"""Group assembly: the pure logic that turns step events into ready prompt groups.

Kept free of Kafka and Faust so that the rules are in one place and testable on
their own; ``streams.app`` stores a ``PendingGroup`` per prompt group in a Faust
table and calls ``add`` for every event.

Rules:
- a step counts once per (trajectory_uid, step_index): redeliveries are ignored;
- a trajectory is complete once its ``is_last`` step or its ``TrajectoryEnd`` has
  arrived and its steps 0..last are all present; when the end names the trajectory's
  steps (``END_STEPS``, as the gateway does), once those are present, and the
  trajectory is exactly those steps: an unnamed one (sent, never acknowledged) is left out;
- a ``TrajectoryEnd`` with a reward sets the reward of the trajectory's last step;
- a group is ready when ``n_rollouts`` trajectories are complete, where
  ``n_rollouts`` is the registered size (on any of its events), else the default.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from enum import Enum

from trajbus.streams.records import ReadyGroup, Step, TrajectoryEnd


class Outcome(str, Enum):
    """What one event did to its group; everything but ACCEPTED/READY is counted."""

    ACCEPTED = "accepted"
    READY = "ready"
    DUPLICATE = "duplicate"
    UNKNOWN_TRAJECTORY = "unknown_trajectory"


@dataclass
class PendingGroup:
    """The assembly state of one prompt group until it is emitted."""

    prompt_uid: str
    channel: str
    n_rollouts: int | None = None
    steps: dict[tuple[str, int], Step] = field(default_factory=dict)
    ended: dict[str, float | None] = field(default_factory=dict)
    """Trajectories that received a TrajectoryEnd, with its reward (None: keep the step's)."""
    members: dict[str, list[int]] = field(default_factory=dict)
    """The step indices of trajectories whose end named them."""
    first_seen: float = field(default_factory=time.time)
    last_offset: int = -1
    """Source offset of the newest event applied: a replayed event at or below it is a duplicate."""

    # -- updates ---------------------------------------------------------------
    def add(self, event: Step | TrajectoryEnd, default_n_rollouts: int) -> Outcome:
        if event.n_rollouts is not None:
            self.n_rollouts = event.n_rollouts
        if isinstance(event, Step):
            if event.key in self.steps:
                return Outcome.DUPLICATE
            self.steps[event.key] = event
        else:
            if not any(uid == event.trajectory_uid for uid, _ in self.steps):
                return Outcome.UNKNOWN_TRAJECTORY
            if event.trajectory_uid in self.ended:
                return Outcome.DUPLICATE
            self.ended[event.trajectory_uid] = event.reward
            if event.steps is not None:
                self.members[event.trajectory_uid] = sorted(event.steps)
        return Outcome.READY if self.is_ready(default_n_rollouts) else Outcome.ACCEPTED

    # -- queries ---------------------------------------------------------------
    def expected_size(self, default_n_rollouts: int) -> int:
        return self.n_rollouts or default_n_rollouts

    def complete_trajectories(self) -> list[str]:
        by_trajectory: dict[str, list[Step]] = {}
        for step in self.steps.values():
            by_trajectory.setdefault(step.trajectory_uid, []).append(step)
        complete = []
        for uid, steps in by_trajectory.items():
            if uid in self.members:
                if {step.step_index for step in steps}.issuperset(self.members[uid]):
                    complete.append(uid)
                continue
            last = max(step.step_index for step in steps)
            closed = uid in self.ended or any(step.is_last for step in steps)
            if closed and len(steps) == last + 1:  # indices are unique, so this means 0..last
                complete.append(uid)
        return sorted(complete)

    def is_ready(self, default_n_rollouts: int) -> bool:
        return len(self.complete_trajectories()) >= self.expected_size(default_n_rollouts)

    def _member(self, step: Step) -> bool:
        named = self.members.get(step.trajectory_uid)
        return named is None or step.step_index in named

    def to_ready_group(self, default_n_rollouts: int, status: str = "complete") -> ReadyGroup:
        """The complete trajectories' steps, ordered by (trajectory_uid, step_index)."""
        chosen = set(self.complete_trajectories())
        steps = sorted((s for s in self.steps.values() if s.trajectory_uid in chosen and self._member(s)),
                       key=lambda s: s.key)
        last_of: dict[str, int] = {}
        for position, step in enumerate(steps):
            last_of[step.trajectory_uid] = position
        for uid, position in last_of.items():
            reward = self.ended.get(uid)
            if reward is not None or not steps[position].is_last:
                steps[position] = dataclasses.replace(
                    steps[position], is_last=True,
                    reward=steps[position].reward if reward is None else reward,
                )
        return ReadyGroup(prompt_uid=self.prompt_uid, channel=self.channel, steps=steps,
                          n_rollouts=self.expected_size(default_n_rollouts), status=status,
                          metadata={"first_seen": self.first_seen})

    # -- persistence (values of the Faust table) ---------------------------------
    def to_record(self) -> ReadyGroup:
        """The pending state in the ReadyGroup encoding, with status ``pending``."""
        return ReadyGroup(prompt_uid=self.prompt_uid, channel=self.channel, steps=list(self.steps.values()),
                          n_rollouts=self.n_rollouts or 0, ready_at=self.first_seen, status="pending",
                          metadata={"ended": self.ended, "members": self.members,
                                    "last_offset": self.last_offset})

    @classmethod
    def from_record(cls, record: ReadyGroup) -> "PendingGroup":
        return cls(prompt_uid=record.prompt_uid, channel=record.channel, n_rollouts=record.n_rollouts or None,
                   steps={step.key: step for step in record.steps}, ended=dict(record.metadata.get("ended", {})),
                   members=dict(record.metadata.get("members", {})),
                   first_seen=record.ready_at, last_offset=record.metadata.get("last_offset", -1))
