"""Admission rules: when a new trajectory may start, and the flags that set the limits."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from trajbus.gateway.admission.rules import (BACKLOG_FULL, BACKLOG_UNKNOWN, FINISHING_SECONDS, POLICY_TOO_STALE,
                                             Admission, AdmissionRules, Backlog, refusal)
from trajbus.gateway.config import add_gateway_arguments, settings_from_args
from trajbus.gateway.errors import GatewayError
from trajbus.gateway.metrics import GatewayMetrics

BASE = ["--vllm-addresses", "127.0.0.1:1", "--tokenizer-path", "tok"]


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    return parser.parse_args([*BASE, *flags])


@pytest.mark.parametrize("rules, backlog, new_group, start, trainer, expected", [
    (AdmissionRules(), Backlog(100, 100, 100), True, 0, 99, None),  # pacing off
    (AdmissionRules(max_backlog_groups=4), Backlog(1, 1, 1), True, None, None, None),
    (AdmissionRules(max_backlog_groups=4), Backlog(2, 1, 1), True, None, None, BACKLOG_FULL),
    (AdmissionRules(max_backlog_groups=4), Backlog(2, 1, 1), False, None, None, None),  # its group is in flight
    (AdmissionRules(max_backlog_groups=4), None, True, None, None, BACKLOG_UNKNOWN),
    (AdmissionRules(max_staleness=2), None, True, 3, 5, None),
    (AdmissionRules(max_staleness=2), None, True, 2, 5, POLICY_TOO_STALE),
    (AdmissionRules(max_staleness=2), None, False, 2, 5, POLICY_TOO_STALE),  # a stale group is dropped anyway
    (AdmissionRules(max_staleness=2), None, True, None, 5, None),  # no version published: nothing to compare
])
def test_refusal(rules, backlog, new_group, start, trainer, expected):
    assert refusal(rules, backlog, new_group, start, trainer) == expected


@pytest.mark.parametrize("flags, message", [
    (["--max-backlog-groups", "0"], "argument --max-backlog-groups: expected a positive integer, got 0"),
    (["--max-staleness", "-1"], "argument --max-staleness: expected a positive integer, got -1"),
    (["--channel-admission", "val.max_backlog_groups=0"], "argument --channel-admission: expected a positive"),
    (["--channel-admission", "val.max_queue=3"], "max_queue: not an admission setting"),
    (["--max-admission-wait", "0"], "argument --max-admission-wait: expected a positive number"),
])
def test_bad_limits_are_usage_errors_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_per_channel_limits_override_the_defaults():
    settings = settings_from_args(parse("--max-backlog-groups", "8",
                                        "--channel-admission", "val.max_backlog_groups=off",
                                        "--channel-admission", "val.max_staleness=1"))
    assert settings.admission == AdmissionRules(8, None)
    assert settings.admission_by_channel == {"val": AdmissionRules(None, 1)}


def admission(mark: int, ready: int | None) -> Admission:
    gate = Admission(AdmissionRules(max_backlog_groups=mark), {}, idle_timeout=600,
                     metrics=GatewayMetrics("test", "http://test"))
    gate.ready = lambda channel: ready
    return gate


def test_admitted_trajectories_are_the_in_flight_count_until_released():
    async def scenario() -> None:
        gate = admission(mark=2, ready=0)
        await gate.admit("a", "train", "p1", lambda: None, lambda: None)
        await gate.admit("b", "train", "p1", lambda: None, lambda: None)  # same group: no new group
        await gate.admit("c", "train", "p2", lambda: None, lambda: None)
        assert gate.in_flight() == {"train": {"p1", "p2"}}
        with pytest.raises(GatewayError) as refused:
            await gate.admit("d", "train", "p3", lambda: None, lambda: None)
        assert refused.value.status == 429 and refused.value.code == BACKLOG_FULL and refused.value.retry_after
        gate.release("b")  # p1 still has "a"
        gate.release("c")  # p2 finished: counted until the lag shows it ready
        assert gate.in_flight() == {"train": {"p1", "p2"}}
        with pytest.raises(GatewayError):
            await gate.admit("d", "train", "p3", lambda: None, lambda: None)
        gate.finishing[("train", "p2")] -= FINISHING_SECONDS + 1
        await gate.admit("d", "train", "p3", lambda: None, lambda: None)
        assert gate.in_flight() == {"train": {"p1", "p3"}} and not gate.finishing

    asyncio.run(scenario())


def test_a_held_trajectory_is_admitted_when_the_signals_change():
    async def scenario() -> None:
        gate = admission(mark=1, ready=1)
        held = asyncio.create_task(gate.admit("a", "train", "p1", lambda: None, lambda: None, wait=30))
        await asyncio.sleep(0)  # let it be refused once and wait
        assert not held.done()
        gate.ready = lambda channel: 0  # the trainer committed
        gate.wake()
        await asyncio.wait_for(held, 5)
        assert "a" in gate.admitted

    asyncio.run(scenario())


def test_abandoned_trajectories_stop_counting():
    gate = admission(mark=1, ready=0)
    gate.add("old", "train", "p1", last_seen=1.0)  # no call since 1970
    assert gate.in_flight() == {}
    asyncio.run(gate.admit("new", "train", "p2", lambda: None, lambda: None))
    assert set(gate.admitted) == {"new"}


def test_a_group_served_by_several_gateways_counts_once_and_its_rollouts_are_not_new_groups():
    async def scenario() -> None:
        gate = admission(mark=2, ready=0)
        gate.elsewhere = lambda channel: {"p1", "p2"}  # two groups at the other gateways of the fleet
        await gate.admit("a", "train", "p1", lambda: None, lambda: None)  # a rollout of p1: no new group
        assert gate.backlog("train") == Backlog(0, 1, 1)  # p1 here, p2 elsewhere: two groups, not three
        with pytest.raises(GatewayError) as refused:
            await gate.admit("b", "train", "p3", lambda: None, lambda: None)
        assert refused.value.code == BACKLOG_FULL
        await gate.admit("c", "train", "p2", lambda: None, lambda: None)  # p2's rollouts go anywhere

    asyncio.run(scenario())
