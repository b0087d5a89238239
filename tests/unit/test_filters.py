"""Group filters: staleness drop or tag, equal-rewards drop, the user's filter, and their order."""

from __future__ import annotations

import pytest

from trajbus.streams.worker.filters import judge, staleness_of, trajectory_rewards
from trajbus.streams.wire.records import ReadyGroup, Step
from trajbus.streams.worker.settings import ChannelSettings


def step(trajectory, index=0, reward=0.0, version=0):
    return Step([1], [2], trajectory, "p", step_index=index, reward=reward, policy_version=version)


def group(*steps):
    return ReadyGroup("p", "train", list(steps), n_rollouts=2)


def test_trajectory_rewards_takes_each_trajectorys_last_step():
    g = group(step("a", 0, reward=9.0), step("a", 1, reward=1.0), step("b", 0, reward=2.0))
    assert trajectory_rewards(g) == [1.0, 2.0]


def test_staleness_is_measured_from_the_oldest_step():
    g = group(step("a", version=5), step("b", version=3))
    assert staleness_of(g, 7) == 4
    assert staleness_of(g, None) is None
    assert staleness_of(group(), 7) is None


def test_stale_group_is_dropped_and_staleness_recorded():
    g = group(step("a", reward=0.0, version=1), step("b", reward=1.0, version=5))
    verdict = judge(g, ChannelSettings(max_staleness=2), current_version=5, custom=None)
    assert (verdict.keep, verdict.reason, verdict.staleness) == (False, "stale", 4)
    assert g.metadata["staleness"] == 4


def test_staleness_at_the_limit_is_kept():
    g = group(step("a", reward=0.0, version=3), step("b", reward=1.0, version=5))
    verdict = judge(g, ChannelSettings(max_staleness=2), current_version=5, custom=None)
    assert verdict.keep and verdict.staleness == 2
    assert "tags" not in g.metadata


def test_stale_group_is_tagged_and_kept_when_the_action_is_tag():
    g = group(step("a", reward=0.0, version=0), step("b", reward=1.0, version=0))
    g.metadata["tags"] = ["earlier"]
    verdict = judge(g, ChannelSettings(max_staleness=1, stale_action="tag"), current_version=3, custom=None)
    assert verdict.keep and verdict.reason is None and verdict.staleness == 3
    assert g.metadata == {"staleness": 3, "tags": ["earlier", "stale"]}


def test_without_a_current_version_nothing_is_stale():
    g = group(step("a", reward=0.0, version=0), step("b", reward=1.0, version=0))
    verdict = judge(g, ChannelSettings(max_staleness=0), current_version=None, custom=None)
    assert verdict.keep and verdict.staleness is None
    assert "staleness" not in g.metadata


def test_equal_rewards_are_dropped_only_when_asked():
    same = [step("a", reward=1.0), step("b", reward=1.0)]
    assert judge(group(*same), ChannelSettings(), 0, None).keep
    verdict = judge(group(*same), ChannelSettings(drop_equal_rewards=True), 0, None)
    assert (verdict.keep, verdict.reason) == (False, "equal_rewards")
    mixed = group(step("a", reward=1.0), step("b", reward=0.5))
    assert judge(mixed, ChannelSettings(drop_equal_rewards=True), 0, None).keep


@pytest.mark.parametrize("result, keep, reason", [
    (True, True, None),
    (1, True, None),
    (False, False, "filtered"),
    (None, False, "filtered"),
    ((True, "ignored"), True, None),
    ((False, "too easy"), False, "filtered: too easy"),
    ((False, ""), False, "filtered"),
])
def test_custom_filter_results(result, keep, reason):
    g = group(step("a", reward=0.0), step("b", reward=1.0))
    verdict = judge(g, ChannelSettings(), 0, lambda _: result)
    assert (verdict.keep, verdict.reason) == (keep, reason)


def test_custom_filter_that_raises_drops_with_the_exception_type():
    def broken(_):
        raise KeyError("x")

    g = group(step("a", reward=0.0), step("b", reward=1.0))
    verdict = judge(g, ChannelSettings(), 0, broken)
    assert (verdict.keep, verdict.reason) == (False, "filter_error: KeyError")


def test_rules_apply_in_order_staleness_then_rewards_then_custom():
    calls = []

    def custom(g):
        calls.append(g.prompt_uid)
        return False, "custom"

    settings = ChannelSettings(max_staleness=0, drop_equal_rewards=True)
    stale_and_equal = group(step("a", reward=1.0, version=0), step("b", reward=1.0, version=0))
    assert judge(stale_and_equal, settings, 1, custom).reason == "stale"
    fresh_and_equal = group(step("a", reward=1.0, version=1), step("b", reward=1.0, version=1))
    assert judge(fresh_and_equal, settings, 1, custom).reason == "equal_rewards"
    assert calls == []  # an earlier rule's drop spares the user's filter
    fresh_and_mixed = group(step("a", reward=1.0, version=1), step("b", reward=0.0, version=1))
    assert judge(fresh_and_mixed, settings, 1, custom).reason == "filtered: custom"
    assert calls == ["p"]


def test_a_tagged_stale_group_still_meets_the_later_rules():
    settings = ChannelSettings(max_staleness=0, stale_action="tag", drop_equal_rewards=True)
    g = group(step("a", reward=1.0, version=0), step("b", reward=1.0, version=0))
    verdict = judge(g, settings, 2, None)
    assert (verdict.keep, verdict.reason, verdict.staleness) == (False, "equal_rewards", 2)
    assert g.metadata["tags"] == ["stale"]


def test_custom_filter_returning_a_one_tuple_is_a_filter_error():
    g = group(step("a", reward=0.0), step("b", reward=1.0))
    verdict = judge(g, ChannelSettings(), 0, lambda _: (False,))
    assert (verdict.keep, verdict.reason) == (False, "filter_error: ValueError")
