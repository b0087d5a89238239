"""A trainer's commit through a lost membership and a moving coordinator: no client exception, nothing lost."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from trajbus.consumers.commits import GroupCommits

OFFSETS = [TopicPartition("t", 0, 7)]


class Consumer:
    """What ``GroupCommits`` asks of librdkafka's consumer: commits that fail as scripted, and its assignment."""

    def __init__(self, failures: list[int]) -> None:
        self.failures = failures
        self.committed: list[list[TopicPartition]] = []
        self.assigned: list[TopicPartition] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        assert asynchronous is False
        if self.failures:
            raise KafkaException(KafkaError(self.failures.pop(0), "scripted"))
        self.committed.append(offsets)

    def assignment(self) -> list[TopicPartition]:
        return self.assigned


def test_a_commit_the_group_refuses_for_a_lost_member_is_made_once_the_consumer_is_assigned_again(caplog):
    consumer = Consumer([KafkaError.UNKNOWN_MEMBER_ID])
    commits = GroupCommits(consumer, "trainer", outage_limit=5)
    with caplog.at_level(logging.INFO, "trajbus.consumers"):
        commits.commit(OFFSETS)  # no exception reaches the training loop
    assert commits.pending == OFFSETS and not consumer.committed
    assert "waits for the consumer to rejoin" in caplog.text
    commits.retry_pending()  # not a member yet: nothing is tried
    assert commits.pending == OFFSETS
    consumer.assigned = [TopicPartition("t", 0)]
    commits.retry_pending()
    assert consumer.committed == [OFFSETS] and commits.pending is None


def test_a_coordinator_on_the_move_is_waited_out():
    consumer = Consumer([KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE])
    GroupCommits(consumer, "trainer", outage_limit=10).commit(OFFSETS)
    assert consumer.committed == [OFFSETS]


def test_a_coordinator_away_past_the_outage_limit_is_said():
    consumer = Consumer([KafkaError.NOT_COORDINATOR] * 100)
    with pytest.raises(KafkaException):
        GroupCommits(consumer, "trainer", outage_limit=0.5).commit(OFFSETS)
