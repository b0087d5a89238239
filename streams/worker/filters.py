"""Filters applied to a ready group before it is emitted, in a fixed order.

1. staleness: the oldest ``policy_version`` of the group against the version on
   the policy topic; more than ``max_staleness`` behind is dropped or tagged;
2. no signal: every trajectory has the same reward (GRPO's advantages are all 0);
3. the user's group filter, by dotted path (slime's dynamic-sampling filter idea).

Each returns a reason when it drops, so the worker can count drops by reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from trajbus.streams.wire.records import ReadyGroup
from trajbus.streams.worker.settings import ChannelSettings

log = logging.getLogger(__name__)

DROP_STALE = "stale"
DROP_NO_SIGNAL = "equal_rewards"
DROP_FILTERED = "filtered"
DROP_FILTER_ERROR = "filter_error"


@dataclass
class Verdict:
    keep: bool
    reason: str | None = None
    staleness: int | None = None


def trajectory_rewards(group: ReadyGroup) -> list[float]:
    """One reward per trajectory: the reward on its last step."""
    last: dict[str, float] = {}
    for step in group.steps:  # ordered by (trajectory_uid, step_index)
        last[step.trajectory_uid] = step.reward
    return list(last.values())


def staleness_of(group: ReadyGroup, current_version: int | None) -> int | None:
    if current_version is None or not group.steps:
        return None
    return current_version - min(step.policy_version for step in group.steps)


def judge(group: ReadyGroup, settings: ChannelSettings, current_version: int | None,
          custom: Callable | None) -> Verdict:
    """Keep or drop ``group`` (tagging it in place where the settings say tag)."""
    staleness = staleness_of(group, current_version)
    if staleness is not None:
        group.metadata["staleness"] = staleness
    if settings.max_staleness is not None and staleness is not None and staleness > settings.max_staleness:
        if settings.stale_action == "drop":
            return Verdict(False, DROP_STALE, staleness)
        group.metadata.setdefault("tags", []).append("stale")
    if settings.drop_equal_rewards and len(set(trajectory_rewards(group))) <= 1:
        return Verdict(False, DROP_NO_SIGNAL, staleness)
    if custom is not None:
        try:
            result = custom(group)
            keep, reason = result if isinstance(result, tuple) else (bool(result), None)  # a bad tuple too
        except Exception as exc:  # noqa: BLE001 - a user's filter must not stop the worker
            log.exception("group filter %s failed on %s", settings.group_filter, group.prompt_uid)
            return Verdict(False, f"{DROP_FILTER_ERROR}: {type(exc).__name__}", staleness)
        if not keep:
            return Verdict(False, f"{DROP_FILTERED}: {reason}" if reason else DROP_FILTERED, staleness)
    return Verdict(True, None, staleness)
