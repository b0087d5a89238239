"""Test helpers: synthetic prompt groups, waiting on conditions with deadlines, reading topics."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from typing import Callable, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from consumers import BatchConsumer
from streams.records import ReadyGroup, Step

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
                         "enable.auto.commit": False, "fetch.wait.max.ms": 50, "auto.offset.reset": "earliest"})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
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



def read_to_end(bootstrap_servers: str, topic: str, timeout: float = 30.0) -> list[Message]:
    """Every record of ``topic`` up to its current end."""
    from infra.topics import describe_topics

    total = describe_topics(bootstrap_servers, names=[topic])[0].records
    return read_topic(bootstrap_servers, topic, min_count=total, timeout=timeout)


def end_offsets(bootstrap_servers: str, topic: str) -> list[int]:
    from infra.topics import describe_topics

    return describe_topics(bootstrap_servers, names=[topic])[0].end_offsets


def trajbus(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the `trajbus` CLI as a user would, capturing its output."""
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def group_steps(prompt_uid: str, trajectories_per_group: int, n_steps: int, rng: random.Random,
                **extra) -> list[list[Step]]:
    """Per trajectory, its steps in order; the last one carries the reward."""
    trajectories = []
    for r in range(trajectories_per_group):
        steps = []
        for i in range(n_steps):
            response = [rng.randrange(150000) for _ in range(rng.randint(1, 8))]
            steps.append(Step(
                prompt_ids=[rng.randrange(150000) for _ in range(rng.randint(1, 12))], response_ids=response,
                trajectory_uid=f"{prompt_uid}/t{r}", prompt_uid=prompt_uid, step_index=i,
                reward=float(r) if i == n_steps - 1 else 0.0, is_last=i == n_steps - 1,
                rollout_log_probs=[-0.5] * len(response), metadata={"i": i}, **extra,
            ))
        trajectories.append(steps)
    return trajectories


def interleave(trajectories: list[list[Step]], rng: random.Random) -> list[Step]:
    """A random merge that keeps each trajectory's own order (as concurrent agents produce)."""
    queues = [list(t) for t in trajectories]
    merged = []
    while queues:
        i = rng.randrange(len(queues))
        merged.append(queues[i].pop(0))
        if not queues[i]:
            queues.pop(i)
    return merged


def fetch_groups(consumer: BatchConsumer, count: int, timeout: float) -> list[ReadyGroup]:
    groups = []
    deadline = time.monotonic() + timeout
    while len(groups) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {len(groups)} of {count} groups arrived within {timeout}s"
        group = consumer.fetch_group(timeout=min(remaining, 2.0))
        if group is not None:
            groups.append(group)
    return groups


def make_groups(n_groups: int, trajectories_per_group: int, n_steps: int, seed: int, tag: str = "g",
                window: int = 50) -> tuple[dict[str, list[Step]], list[Step]]:
    """``n_groups`` groups: the steps sent per prompt_uid, and all steps as agents send them:
    interleaved across the trajectories of ``window`` groups at a time, as rollout workers do."""
    rng = random.Random(seed)
    sent: dict[str, list[Step]] = {}
    stream: list[Step] = []
    for first in range(0, n_groups, window):
        trajectories = []
        for g in range(first, min(first + window, n_groups)):
            per_group = group_steps(f"{tag}{g:04d}", trajectories_per_group, n_steps, rng)
            sent[f"{tag}{g:04d}"] = [s for t in per_group for s in t]
            trajectories += per_group
        stream += interleave(trajectories, rng)
    return sent, stream


def assert_exactly_the_groups_sent(groups: list[ReadyGroup], sent: dict[str, list[Step]]) -> None:
    """Every sent group once, each complete with its steps in (trajectory_uid, step_index) order."""
    uids = [g.prompt_uid for g in groups]
    assert len(uids) == len(set(uids)), f"{len(uids) - len(set(uids))} groups arrived twice"
    assert set(uids) == set(sent)
    for group in groups:
        expected = sorted(sent[group.prompt_uid], key=lambda s: (s.trajectory_uid, s.step_index))
        assert [(s.trajectory_uid, s.step_index, s.prompt_ids, s.response_ids, s.reward) for s in group.steps] == \
            [(s.trajectory_uid, s.step_index, s.prompt_ids, s.response_ids, s.reward) for s in expected]
