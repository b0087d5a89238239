"""Which trajectories an export keeps: by reward, policy version, staleness (``trajbus export``'s filters).

Each filter looks at one trajectory (a row), not its whole group: an export is a dataset, not a
GRPO batch. Staleness is what a trainer measures (``consumers.off_policy.staleness``): how many
versions a reference policy is ahead of the oldest version that sampled a token of the trajectory.
The reference is ``current_version`` when given, else the newest version the export has seen so
far, this group's included (kept in each part, so a resumed export goes on from the same one).
"""

from __future__ import annotations

from dataclasses import dataclass

from trajbus.pipelines.export_rows import TrajectoryTokens

__all__ = ["TrajectoryFilter", "parse_versions"]


def parse_versions(text: str) -> frozenset[int]:
    """``"2,3"``, ``"2-5"`` (inclusive) or both (``"1,4-6"``); ``ValueError`` naming what is wrong."""
    versions: set[int] = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        low, dash, high = item.partition("-") if not item.startswith("-") else (item, "", "")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"--policy-version: expected versions such as 2,3 or a range 2-5, got {text!r}") from None
        if last < first:
            raise ValueError(f"--policy-version: the range {item!r} ends before it starts")
        if last - first > 1_000_000:
            raise ValueError(f"--policy-version: the range {item!r} is too wide")
        versions.update(range(first, last + 1))
    if not versions:
        raise ValueError(f"--policy-version: expected versions such as 2,3 or a range 2-5, got {text!r}")
    return frozenset(versions)


@dataclass(frozen=True)
class TrajectoryFilter:
    """The rules a kept trajectory meets; a rule left None keeps everything."""

    min_reward: float | None = None
    max_reward: float | None = None
    policy_versions: frozenset[int] | None = None
    """Every version that sampled a token of the trajectory is one of these."""
    max_staleness: int | None = None
    current_version: int | None = None
    """The staleness reference; None: the newest version seen."""

    def __post_init__(self) -> None:
        if self.min_reward is not None and self.max_reward is not None and self.max_reward < self.min_reward:
            raise ValueError(f"--max-reward {self.max_reward:g} is below --min-reward {self.min_reward:g}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"--max-staleness: expected a number of versions >= 0, got {self.max_staleness}")

    def keeps(self, trajectory: TrajectoryTokens, newest_seen: int | None) -> bool:
        reward, versions = trajectory.reward, trajectory.versions
        if self.min_reward is not None and reward < self.min_reward:
            return False
        if self.max_reward is not None and reward > self.max_reward:
            return False
        if self.policy_versions is not None and not versions <= self.policy_versions:
            return False
        reference = self.current_version if self.current_version is not None else newest_seen
        if self.max_staleness is not None and reference is not None and reference - min(versions) > self.max_staleness:
            return False
        return True
