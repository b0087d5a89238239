"""Filters, duplicates, late steps, timeouts and bad events, against one worker on the real broker.

One worker serves a channel per rule, configured the way an operator would:
``--channel-setting CHANNEL.SETTING=VALUE``.
"""

from __future__ import annotations

import json
import random
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from kafka.partitioner.default import murmur2
from confluent_kafka import Producer

from trajbus.consumers import BatchConsumer
from trajbus.consumers.replay import Replay
from trajbus.infra.local import free_port
from trajbus.infra.topics import ensure_topics
from trajbus.pipelines.processes import worker_process
from trajbus.pipelines.synthetic import group_steps
from trajbus.streams.client.policy import PolicyVersionPublisher
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire import codec
from trajbus.streams.wire.dlq import REASON, SOURCE_TOPIC
from trajbus.streams.wire.prefix import PROMPT_EXTENDS_STEP, StepDelta
from trajbus.streams.wire.records import ChunkedGroup, ReadyGroup, Step
from trajbus.streams.wire.topics import dlq_topic, groups_topic, steps_topic
from trajbus.streams.wire.stats import summarize
from trajbus.streams.client.snapshots import read_snapshots
from tests.helpers import fetch_groups, read_to_end, trajbus, wait_for

CHANNELS = "train,stale,tagged,flat,custom,timeout,big"


METRICS_PORT = free_port()
RULES = [
    "stale.max_staleness=1", "tagged.max_staleness=1", "tagged.stale_action=tag",
    "flat.drop_equal_rewards=true", "custom.group_filter=tests.group_filters:drop_marked",
    "timeout.group_timeout=3", "timeout.min_rollouts=2", "big.max_group_bytes=30000000",
]


@pytest.fixture(scope="module")
def rules(bootstrap_servers: str, tmp_path_factory: pytest.TempPathFactory):
    prefix = f"r{uuid.uuid4().hex[:10]}"
    ensure_topics(bootstrap_servers, TopicSettings(prefix=prefix).specs(CHANNELS.split(",")))
    extra = [arg for rule in RULES for arg in ("--channel-setting", rule)]
    extra += ["--metrics-port", str(METRICS_PORT)]
    log = Path(tmp_path_factory.mktemp("rules")) / "worker.log"
    worker = worker_process(bootstrap_servers, prefix, log, channels=CHANNELS, n_rollouts=2, extra=extra).start()
    producer = StepProducer(bootstrap_servers, prefix=prefix)
    yield prefix, producer
    producer.close()
    worker.stop()


def stats(bootstrap_servers: str, prefix: str, channel: str) -> dict:
    return summarize(read_snapshots(bootstrap_servers, prefix)).get(channel, {})


def a_group(uid: str, rewards: list[float], version: int = 0, n_steps: int = 1) -> list[Step]:
    trajectories = group_steps(uid, len(rewards), n_steps, random.Random(uid))
    for trajectory, reward in zip(trajectories, rewards):
        for step in trajectory:
            step.policy_version = version
        trajectory[-1].reward = reward
    return [s for t in trajectories for s in t]


def only_group(bootstrap_servers: str, prefix: str, channel: str, timeout: float = 60) -> ReadyGroup:
    """The channel's one group, and nothing else up to the topic's end. Call it once the worker
    has decided on every other group of the channel (their drops counted)."""
    with BatchConsumer(channel, bootstrap_servers, prefix=prefix) as consumer:
        group = fetch_groups(consumer, 1, timeout)[0]
        assert consumer.drain() == [], f"{channel}: a second group arrived"
    return group


def steps_partition(prompt_uid: str) -> int:
    """The steps partition of a prompt (the Java client's murmur2 partitioner, as StepProducer uses)."""
    return (murmur2(prompt_uid.encode()) & 0x7FFFFFFF) % TopicSettings().steps_partitions


def dlq_reasons(bootstrap_servers: str, prefix: str, channel: str) -> list[str]:
    """Dead-letter reasons of the records that came from ``channel``'s steps topic (each test has its own)."""
    source = steps_topic(channel, prefix).encode()
    return [dict(m.headers())[REASON].decode() for m in read_to_end(bootstrap_servers, dlq_topic(prefix))
            if dict(m.headers())[SOURCE_TOPIC] == source]


def test_stale_groups_are_dropped_and_counted(bootstrap_servers, rules):
    prefix, producer = rules
    with PolicyVersionPublisher(bootstrap_servers, prefix=prefix) as publisher:
        publisher.publish(5)
    wait_for(lambda: stats(bootstrap_servers, prefix, "stale").get("policy_version") == 5, 60,
             "the worker to see policy version 5")
    producer.submit_steps(a_group("old", [0.0, 1.0], version=3), channel="stale")  # 2 behind: dropped
    producer.submit_steps(a_group("fresh", [0.0, 1.0], version=4), channel="stale")  # 1 behind: kept
    # the two groups may sit on two partitions: a snapshot can count the drop before the other's emission
    row = wait_for(lambda: (r := stats(bootstrap_servers, prefix, "stale")).get("groups_dropped[stale]")
                   and r.get("groups[emitted]") and r, 30, "the stale drop and the fresh emission to be counted")
    group = only_group(bootstrap_servers, prefix, "stale")
    assert group.prompt_uid == "fresh" and group.metadata["staleness"] == 1
    assert row["groups_dropped[stale]"] == 1 and row["groups[emitted]"] == 1
    assert row["staleness_le"]["1.0"] == 1 and row["staleness_le"]["2.0"] == 2


def test_stale_groups_can_be_tagged_instead(bootstrap_servers, rules):
    prefix, producer = rules
    with PolicyVersionPublisher(bootstrap_servers, prefix=prefix, channel="tagged") as publisher:
        publisher.publish(9)
    wait_for(lambda: stats(bootstrap_servers, prefix, "tagged").get("policy_version") == 9, 60,
             "the worker to see policy version 9 for channel tagged")
    producer.submit_steps(a_group("old", [0.0, 1.0], version=2), channel="tagged")
    group = only_group(bootstrap_servers, prefix, "tagged")
    assert group.metadata["tags"] == ["stale"] and group.metadata["staleness"] == 7


@pytest.mark.parametrize("channel, dropped, kept, reason", [
    ("flat", a_group("same", [1.0, 1.0]), a_group("mixed", [1.0, 0.0]), "equal_rewards"),
    ("custom", a_group("p1-drop", [0.0, 1.0]), a_group("p2-keep", [0.0, 1.0]), "filtered: marked"),
])
def test_group_filters_drop_and_count_by_reason(bootstrap_servers, rules, channel, dropped, kept, reason):
    """No reward variance, and a user's filter by dotted path (it names its own reason)."""
    prefix, producer = rules
    producer.submit_steps(dropped, channel=channel)
    producer.submit_steps(kept, channel=channel)
    wait_for(lambda: stats(bootstrap_servers, prefix, channel).get(f"groups_dropped[{reason}]") == 1, 30,
             f"the drop to be counted as {reason}")
    assert only_group(bootstrap_servers, prefix, channel).prompt_uid == kept[0].prompt_uid


def test_group_timeout_emits_partial_or_drops(bootstrap_servers, rules):
    prefix, producer = rules
    # Both groups register 3 rollouts; the first completes 2 (>= min_rollouts), the second 1.
    partial = a_group("partial", [0.0, 1.0, 1.0], n_steps=2)
    producer.submit_steps([s for s in partial if not (s.trajectory_uid.endswith("t2") and s.is_last)],
                          channel="timeout", n_rollouts=3)
    starved = a_group("starved", [0.0, 1.0], n_steps=2)
    producer.submit_steps([s for s in starved if s.trajectory_uid.endswith("t0")], channel="timeout", n_rollouts=3)
    wait_for(lambda: stats(bootstrap_servers, prefix, "timeout").get("groups_dropped[timeout]") == 1, 60,
             "the starved group to be dropped on timeout")
    group = only_group(bootstrap_servers, prefix, "timeout")
    assert group.prompt_uid == "partial" and group.status == "partial"
    assert group.trajectory_uids == ["partial/t0", "partial/t1"] and len(group.steps) == 4
    # A step for a group that timed out is late: it goes to the DLQ, never into a new group.
    producer.submit_steps([s for s in starved if s.trajectory_uid.endswith("t1")][:1], channel="timeout")
    reasons = wait_for(lambda: dlq_reasons(bootstrap_servers, prefix, "timeout"), 30, "the late step on the DLQ")
    assert len(reasons) == 1 and reasons[0].startswith("late: group already dropped (timeout)"), reasons


def test_duplicates_count_once_and_bad_events_go_to_dlq(bootstrap_servers, rules):
    prefix, producer = rules
    steps = a_group("dup", [0.0, 1.0], n_steps=2)
    producer.submit_steps(steps[:3], channel="train")
    producer.submit_steps(steps[:3], channel="train")  # an agent retrying a batch
    producer.submit_steps(steps[3:], channel="train")
    group = only_group(bootstrap_servers, prefix, "train")
    assert [(s.trajectory_uid, s.step_index) for s in group.steps] == [(s.trajectory_uid, s.step_index)
                                                                       for s in steps]
    wait_for(lambda: stats(bootstrap_servers, prefix, "train").get("duplicate_events", 0) >= 3, 30,
             "the three redelivered steps to be counted as duplicates")

    producer.submit_steps(steps[-1:], channel="train")  # after emission: late
    producer.complete_trajectory("nobody", "ghost", reward=1.0, channel="train")  # unknown trajectory
    raw = Producer({"bootstrap.servers": bootstrap_servers, "partitioner": "murmur2_random"})
    wrong = Step(prompt_ids=[1], response_ids=[2], trajectory_uid="x", prompt_uid="y", channel="val")
    raw.produce(steps_topic("train", prefix), key=b"y", value=codec.encode(wrong))  # channel mismatch
    orphan = Step(prompt_ids=[5], response_ids=[6], trajectory_uid="o/t0", prompt_uid="o", step_index=1)
    raw.produce(steps_topic("train", prefix), key=b"o",  # extends a step 0 that was never sent
                value=codec.encode(StepDelta(orphan, PROMPT_EXTENDS_STEP, prefix_len=3, base_index=0)))
    assert raw.flush(30) == 0
    raw.close()
    reasons = wait_for(lambda: len(r := dlq_reasons(bootstrap_servers, prefix, "train")) >= 4 and r,
                       60, "four DLQ records from channel train")
    assert len(reasons) == 4, reasons
    assert sum(r.startswith("prefix_mismatch: step o/t0#1 extends step 0") for r in reasons) == 1
    assert sum(r.startswith("late: group already emitted") for r in reasons) == 1
    assert sum(r.startswith("unknown_trajectory: nobody") for r in reasons) == 1
    assert sum(r.startswith("channel_mismatch: record says 'val'") for r in reasons) == 1


def tokens(step: Step) -> tuple:
    return (step.trajectory_uid, step.step_index, step.prompt_ids, step.response_ids, step.rollout_log_probs,
            step.reward, step.is_last)


def sampled(steps: list[Step], seed: int) -> list[Step]:
    """Agentic sizes: 400k sampled tokens with log-probs a step (~3.2 MB; every step alone fits a record)."""
    rng = np.random.default_rng(seed)
    for step in steps:
        step.response_ids = rng.integers(0, 150_000, 400_000).tolist()
        step.rollout_log_probs = (-rng.random(400_000, dtype=np.float32) * 5).tolist()
    return steps


def test_a_group_over_max_message_bytes_travels_in_chunks_one_over_max_group_bytes_goes_to_the_dlq(
        bootstrap_servers, rules):
    """2 rollouts x 3 turns of 400k tokens: ~19 MB as one group record, over the topics' 16 MiB
    max.message.bytes, so it travels as chunks; 2 x 5 turns (~32 MB) is over the channel's
    max_group_bytes (30 MB): its reason goes to the DLQ and assembly goes on."""
    prefix, producer = rules
    huge, huger = sampled(a_group("huge", [0.0, 1.0], n_steps=3), 1), sampled(a_group("huger", [0.0, 1.0], 0, 5), 2)
    same_partition = next(uid for uid in (f"after-{i}" for i in range(1000))
                          if steps_partition(uid) == steps_partition("huger"))
    for steps in (huge, huger, a_group(same_partition, [0.0, 1.0])):
        producer.submit_steps(steps, channel="big")
    with BatchConsumer("big", bootstrap_servers, prefix=prefix) as consumer:
        got = {group.prompt_uid: group for group in fetch_groups(consumer, 2, timeout=120)}
        assert consumer.drain() == [], "a group arrived twice"
    assert set(got) == {"huge", same_partition}, "the next group of the same partition is still assembled"
    assert [tokens(s) for s in got["huge"].steps] == [tokens(s) for s in sorted(huge, key=lambda s: s.key)], \
        "whole and exact"
    records = [codec.decode(m.value()) for m in read_to_end(bootstrap_servers, groups_topic("big", prefix))]
    [manifest] = [r for r in records if isinstance(r, ChunkedGroup)]
    assert manifest.prompt_uid == "huge" and len(manifest.offsets) == 2 and manifest.size > 16 * 2**20
    with Replay("big", bootstrap_servers, prefix=prefix) as replay:
        replayed = [g for g in replay.groups() if g.prompt_uid == "huge"]
    assert [[tokens(s) for s in g.steps] for g in replayed] == [[tokens(s) for s in got["huge"].steps]]

    reasons = wait_for(lambda: dlq_reasons(bootstrap_servers, prefix, "big"), 60, "the reason on the DLQ")
    assert len(reasons) == 1 and reasons[0].startswith("too_large: group of ")
    assert "(2 trajectories, 10 steps) exceeds max_group_bytes 30000000" in reasons[0]
    wait_for(lambda: stats(bootstrap_servers, prefix, "big").get("groups_dropped[too_large]", 0) == 1, 30,
             "the drop counted by reason")


def test_stats_cli_reports_per_channel(bootstrap_servers, rules):
    prefix, producer = rules
    producer.submit_steps(a_group("cli", [0.0, 1.0]), channel="train")
    wait_for(lambda: stats(bootstrap_servers, prefix, "train").get("groups[emitted]", 0) >= 1, 60,
             "a group emitted on train")
    result = trajbus("stats", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["workers"] >= 1
    assert report["channels"]["train"]["events[step]"] >= 2
    table = trajbus("stats", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix)
    assert table.returncode == 0 and "train" in table.stdout and "emitted" in table.stdout


def test_worker_serves_prometheus_metrics(bootstrap_servers, rules):
    prefix, producer = rules
    with PolicyVersionPublisher(bootstrap_servers, prefix=prefix) as publisher:  # staleness is against it
        publisher.publish(5)
    wait_for(lambda: stats(bootstrap_servers, prefix, "train").get("policy_version") == 5, 60,
             "the worker to see policy version 5")
    producer.submit_steps(a_group("metrics", [0.0, 1.0], version=5), channel="train")

    def scrape() -> str | None:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
        except OSError:
            return None
        return text if 'trajbus_worker_groups_total{channel="train",outcome="emitted"}' in text else None

    text = wait_for(scrape, 60, "the worker's /metrics to show emitted groups")
    for name in ("trajbus_worker_events_total", "trajbus_worker_pending_groups", "trajbus_groups_queue_depth",
                 "trajbus_worker_group_staleness_bucket", "trajbus_worker_groups_dropped_total"):
        assert name in text
