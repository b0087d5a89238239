"""Test helpers: waiting on conditions with deadlines, reading topics with a plain client."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, TypeVar

from confluent_kafka import Consumer, Message, TopicPartition
from confluent_kafka.admin import AdminClient

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def read_topic(bootstrap_servers: str, topic: str, min_count: int = 0, timeout: float = 30.0,
               until: Callable[[list[Message]], bool] | None = None) -> list[Message]:
    """Every record of ``topic`` from the beginning, read until ``min_count`` (or ``until``) holds."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "tests.read_topic",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 50})
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    done = until or (lambda got: len(got) >= min_count)
    messages: list[Message] = []
    deadline = time.monotonic() + timeout
    try:
        while not done(messages):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s reading {topic}: got {len(messages)} records")
            message = consumer.poll(0.2)
            if message is not None and not message.error():
                messages.append(message)
        return messages
    finally:
        consumer.close()



def end_offsets(bootstrap_servers: str, topic: str) -> list[int]:
    from infra.topics import describe_topics

    return describe_topics(bootstrap_servers, names=[topic])[0].end_offsets


def trajbus(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the `trajbus` CLI as a user would, capturing its output."""
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
