"""The gateway raises its soft open-files limit to hold two sockets per call in flight (issue 47): with the
common default of 1,024, the 1,000th agent's call would fail to be accepted."""

from __future__ import annotations

import logging
import resource

import pytest

from trajbus.gateway.server import SPARE_FILES, raise_open_files_limit

NOFILE = resource.RLIMIT_NOFILE


@pytest.fixture
def limits():
    """The process's open-files limits, put back after the test."""
    soft, hard = resource.getrlimit(NOFILE)
    yield soft, hard
    resource.setrlimit(NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_to_two_sockets_per_call(limits):
    _, hard = limits
    calls = min(2048, (hard - SPARE_FILES) // 2) if hard != resource.RLIM_INFINITY else 2048
    resource.setrlimit(NOFILE, (256, hard))
    raise_open_files_limit(calls)
    assert resource.getrlimit(NOFILE) == (2 * calls + SPARE_FILES, hard)


def test_a_limit_already_high_enough_is_left_alone(limits):
    soft, hard = limits
    raise_open_files_limit(1)
    assert resource.getrlimit(NOFILE) == (soft, hard)


def test_a_hard_limit_too_low_raises_to_it_and_says_how_many_calls_fit(limits, caplog):
    _, hard = limits
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard open-files limit on this machine")
    resource.setrlimit(NOFILE, (256, hard))
    with caplog.at_level(logging.WARNING, logger="trajbus.gateway"):
        raise_open_files_limit(hard)  # needs 2 * hard + spare
    assert resource.getrlimit(NOFILE) == (hard, hard)
    assert f"about {(hard - SPARE_FILES) // 2} calls in flight fit, not the {hard}" in caplog.text
