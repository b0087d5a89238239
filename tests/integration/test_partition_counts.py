"""Partition counts change only on purpose (issue 35): provisioning never raises an existing topic's count,
a worker given another count than its steps topic has refuses to start, and `trajbus topics --create` with a
partition flag is the one way to raise it."""

from __future__ import annotations

import logging

import pytest
from kafka.partitioner.default import murmur2

from trajbus.consumers import BatchConsumer
from trajbus.infra.topics import describe_topics, ensure_topics
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.records import Step
from trajbus.streams.wire.topics import steps_topic
from tests.helpers import read_topic, trajbus, wait_for


def _partitions(bootstrap_servers: str, topic: str) -> int:
    return describe_topics(bootstrap_servers, names=[topic])[0].partitions


def _create(bootstrap_servers: str, prefix: str, *flags: str) -> None:
    result = trajbus("topics", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--create",
                     "--channels", "train", *flags)
    assert result.returncode == 0, result.stderr


def test_a_producer_leaves_a_smaller_steps_topic_as_it_is_and_warns_once(bootstrap_servers: str, prefix: str,
                                                                         caplog: pytest.LogCaptureFixture):
    """The repro: topics created with 3 partitions, then producers with the default settings (8)."""
    _create(bootstrap_servers, prefix, "--steps-partitions", "3")
    topic = steps_topic("train", prefix)
    step = Step(prompt_ids=[1], response_ids=[2], prompt_uid="p-kept", trajectory_uid="p-kept/r0", is_last=True)
    with caplog.at_level(logging.WARNING, logger="trajbus"):
        for _ in range(2):  # two producers of one process: one warning line
            with StepProducer(bootstrap_servers, prefix=prefix) as producer:
                assert producer.submit_steps([step]) == 1
    assert _partitions(bootstrap_servers, topic) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and topic in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "3 partitions" in warnings[0] and "8" in warnings[0] and "--steps-partitions" in warnings[0]
    # the key's partition is the one of the topic's own count: a group's events stay together
    messages = read_topic(bootstrap_servers, topic, min_count=2)
    assert {m.partition() for m in messages} == {(murmur2(b"p-kept") & 0x7FFFFFFF) % 3}


def test_topics_create_raises_a_count_only_when_its_flag_says_so(bootstrap_servers: str, prefix: str):
    _create(bootstrap_servers, prefix, "--steps-partitions", "3")
    topic = steps_topic("train", prefix)
    _create(bootstrap_servers, prefix)  # the default (8) is no request to raise it
    assert _partitions(bootstrap_servers, topic) == 3
    _create(bootstrap_servers, prefix, "--steps-partitions", "4")  # on purpose
    assert _partitions(bootstrap_servers, topic) == 4


def test_a_worker_given_another_count_than_its_steps_topic_refuses_to_start(bootstrap_servers: str, prefix: str,
                                                                          start_worker):
    _create(bootstrap_servers, prefix, "--steps-partitions", "3")
    worker = start_worker()  # --steps-partitions 8, the default
    wait_for(lambda: not worker.alive(), 30, "the worker to refuse to start")
    assert worker.process.returncode == 2, worker.log_tail()
    lines = [line for line in worker.log_tail().splitlines() if steps_topic("train", prefix) in line]
    assert len(lines) == 1 and "3" in lines[0] and "8" in lines[0] and "--steps-partitions" in lines[0], lines
    assert _partitions(bootstrap_servers, steps_topic("train", prefix)) == 3


def test_a_worker_given_a_count_raised_on_purpose_raises_its_changelog_and_assembles(
        bootstrap_servers: str, prefix: str, start_worker):
    """After `topics --create --steps-partitions 4` on a 3-partition topic, a worker given 4 starts: its table's
    changelog (left at 3 by an earlier worker) follows its steps topic, as Faust needs, and groups flow."""
    _create(bootstrap_servers, prefix, "--steps-partitions", "3")
    changelog = f"{prefix}-worker-train-assembly-changelog"
    ensure_topics(bootstrap_servers, [TopicSettings(prefix=prefix).table_spec(changelog, 3)])  # an earlier worker's
    _create(bootstrap_servers, prefix, "--steps-partitions", "4")
    worker = start_worker(n_rollouts=2, extra=["--steps-partitions", "4"])
    uid = "p-raised-0"  # on partition 3: one the old changelog lacks
    assert (murmur2(uid.encode()) & 0x7FFFFFFF) % 4 == 3
    steps = [Step(prompt_ids=[1], response_ids=[r], prompt_uid=uid, trajectory_uid=f"{uid}/r{r}", is_last=True)
             for r in range(2)]
    with StepProducer(bootstrap_servers, settings=TopicSettings(prefix=prefix, steps_partitions=4)) as producer:
        producer.submit_steps(steps)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:
        group = trainer.fetch_batch(timeout=30)
    assert group is not None and len(group) == 2, worker.log_tail()
    assert _partitions(bootstrap_servers, changelog) == 4
    assert _partitions(bootstrap_servers, steps_topic("train", prefix)) == 4
