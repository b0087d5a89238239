"""The policy version the engines serve has one owner (gateway.state.served_version): the newer of the policy
topic's and the last resume's, which stamps steps, bounds admission's staleness and answers a pause."""

from __future__ import annotations

import pytest

from trajbus.gateway.errors import GatewayError
from trajbus.gateway.state.served_version import ServedVersion
from tests.unit.test_update_gate import Published


def test_nothing_known_stamps_0_and_leaves_admission_unbounded():
    served = ServedVersion("trajbus", "train")
    assert served.serving() is None and served.stamp() == 0 and served.trainer("train") is None
    assert served.versions() == {}


def test_the_newer_of_the_topic_s_version_and_the_resume_s_is_the_one_served():
    published = Published(3)
    served = ServedVersion("trajbus", "train", published)
    assert served.serving() == 3 and served.stamp("val") == 3
    served.resume(5)  # the engines were loaded before the trainer's record is read
    assert served.serving() == 5 and served.resumed == 5
    published.version = 7  # then the topic moves past it
    assert served.serving() == 7 and served.stamp() == 7 and served.resumed == 5


def test_a_resume_older_than_the_version_served_is_a_409():
    served = ServedVersion("trajbus", "train", Published(7))
    with pytest.raises(GatewayError, match="older than the version served, 7") as older:
        served.resume(6)
    assert older.value.status == 409 and served.resumed is None
