"""Group assembly: the pure logic that turns step events into ready prompt groups.

Kept free of Kafka and Faust so that the rules are in one place and testable on
their own; ``streams.worker.assembler`` stores a ``PendingGroup`` per prompt group in a Faust
table and calls ``add`` for every event.

A pending group holds *where* its steps are (their source offsets) and what readiness
needs (which step closes a trajectory), never their bodies: the steps topic already
holds those durably. So applying an event costs the group's index, not its tokens,
and the bodies are read once, when the group is emitted (``to_ready_group``).

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
import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

from trajbus.streams.wire.prefix import StepDelta, step_of, with_step
from trajbus.streams.wire.records import ReadyGroup, Step, TrajectoryEnd


class EventEffect(str, Enum):
    """What one event did to its group; everything but ACCEPTED/READY is counted."""

    ACCEPTED = "accepted"
    READY = "ready"
    DUPLICATE = "duplicate"
    UNKNOWN_TRAJECTORY = "unknown_trajectory"


@dataclass
class PendingGroup:
    """The assembly state of one prompt group until it is emitted: an index of its steps."""

    prompt_uid: str
    channel: str
    n_rollouts: int | None = None
    trajectories: dict[str, dict[int, int]] = field(default_factory=dict)
    """Per trajectory, the source offset of each step index it has."""
    closed: set[str] = field(default_factory=set)
    """Trajectories one of whose steps says ``is_last``."""
    ended: dict[str, float | None] = field(default_factory=dict)
    """Trajectories that received a TrajectoryEnd, with its reward (None: keep the step's)."""
    members: dict[str, list[int]] = field(default_factory=dict)
    """The step indices of trajectories whose end named them."""
    first_seen: float = field(default_factory=time.time)
    last_offset: int = -1
    """Source offset of the newest event applied: a replayed event at or below it is a duplicate."""

    # -- updates ---------------------------------------------------------------
    def add(self, event: Step | TrajectoryEnd, offset: int, default_n_rollouts: int) -> EventEffect:
        """Apply ``event``, read at source ``offset``."""
        if event.n_rollouts is not None:
            self.n_rollouts = event.n_rollouts
        if isinstance(event, Step):
            steps = self.trajectories.setdefault(event.trajectory_uid, {})
            if event.step_index in steps:
                return EventEffect.DUPLICATE
            steps[event.step_index] = offset
            if event.is_last:
                self.closed.add(event.trajectory_uid)
        else:
            if event.trajectory_uid not in self.trajectories:
                return EventEffect.UNKNOWN_TRAJECTORY
            if event.trajectory_uid in self.ended:
                return EventEffect.DUPLICATE
            self.ended[event.trajectory_uid] = event.reward
            if event.steps is not None:
                self.members[event.trajectory_uid] = sorted(event.steps)
        return EventEffect.READY if self.is_ready(default_n_rollouts) else EventEffect.ACCEPTED

    # -- queries ---------------------------------------------------------------
    def expected_size(self, default_n_rollouts: int) -> int:
        return self.n_rollouts or default_n_rollouts

    def is_complete(self, uid: str) -> bool:
        steps = self.trajectories[uid]
        if uid in self.members:
            return set(steps).issuperset(self.members[uid])
        closed = uid in self.ended or uid in self.closed
        return closed and len(steps) == max(steps) + 1  # indices are unique, so this means 0..last

    def complete_trajectories(self) -> list[str]:
        return sorted(uid for uid in self.trajectories if self.is_complete(uid))

    def is_ready(self, default_n_rollouts: int) -> bool:
        return len(self.complete_trajectories()) >= self.expected_size(default_n_rollouts)

    def chosen_offsets(self) -> dict[tuple[str, int], int]:
        """(trajectory_uid, step_index) -> source offset of the steps a ready group carries, in that order:
        the complete trajectories, only their named steps where the end named them."""
        chosen = {}
        for uid in self.complete_trajectories():
            named = self.members.get(uid)
            for index, offset in sorted(self.trajectories[uid].items()):
                if named is None or index in named:
                    chosen[(uid, index)] = offset
        return chosen

    def offsets(self) -> list[int]:
        """Every source offset of a step this group holds."""
        return [offset for steps in self.trajectories.values() for offset in steps.values()]

    def to_ready_group(self, bodies: Mapping[int, Step | StepDelta], default_n_rollouts: int,
                       status: str = "complete") -> tuple[ReadyGroup, list[Step | StepDelta]]:
        """The complete trajectories' steps (``bodies`` by source offset: at least ``chosen_offsets``),
        ordered by (trajectory_uid, step_index); each trajectory's last step carries its end's reward.
        Also the same records as read, for ``prefix.regroup``: a ``StepDelta``'s step (in the group
        too) holds only the tokens after its prefix."""
        records = [bodies[offset] for offset in self.chosen_offsets().values()]
        last_of: dict[str, int] = {}
        for position, record in enumerate(records):
            last_of[step_of(record).trajectory_uid] = position
        for uid, position in last_of.items():
            reward, step = self.ended.get(uid), step_of(records[position])
            if reward is not None or not step.is_last:
                records[position] = with_step(records[position], dataclasses.replace(
                    step, is_last=True, reward=step.reward if reward is None else reward))
        ready = ReadyGroup(prompt_uid=self.prompt_uid, channel=self.channel, steps=[step_of(r) for r in records],
                           n_rollouts=self.expected_size(default_n_rollouts), status=status,
                           metadata={"first_seen": self.first_seen})
        return ready, records

    # -- persistence (values of the Faust table) ---------------------------------
    def encode(self) -> bytes:
        """The index as compact JSON: bytes proportional to the group's steps, not to their tokens."""
        return json.dumps({
            "n": self.n_rollouts, "t": self.trajectories, "closed": sorted(self.closed), "ended": self.ended,
            "members": self.members, "first_seen": self.first_seen, "last_offset": self.last_offset,
            "prompt_uid": self.prompt_uid, "channel": self.channel,
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "PendingGroup":
        data = json.loads(raw)
        return cls(prompt_uid=data["prompt_uid"], channel=data["channel"], n_rollouts=data["n"],
                   trajectories={uid: {int(i): o for i, o in steps.items()} for uid, steps in data["t"].items()},
                   closed=set(data["closed"]), ended=data["ended"], members=data["members"],
                   first_seen=data["first_seen"], last_offset=data["last_offset"])
