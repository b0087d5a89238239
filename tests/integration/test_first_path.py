"""The first path on the real broker: submit -> worker -> consumer, and the DLQ."""

from __future__ import annotations

import random

import pytest
from confluent_kafka import Producer

from trajbus.consumers import BatchConsumer
from trajbus.pipelines.synthetic import group_steps, interleave
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire import codec
from trajbus.streams.wire.dlq import REASON, SOURCE_OFFSET, SOURCE_TOPIC
from trajbus.streams.wire.records import Step
from trajbus.streams.wire.topics import dlq_topic, steps_topic
from tests.helpers import end_offsets, fetch_groups, read_topic, settle_workers


def test_200_groups_arrive_exactly_once_complete_and_in_order(bootstrap_servers, prefix, start_worker):
    rng = random.Random(7)
    n_groups, n_rollouts, n_steps = 200, 4, 3
    sent: dict[str, list[Step]] = {}
    trajectories = []
    for g in range(n_groups):
        per_group = group_steps(f"g{g:03d}", n_rollouts, n_steps, rng)
        sent[f"g{g:03d}"] = [s for t in per_group for s in t]
        trajectories += per_group
    stream = interleave(trajectories, rng)

    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        worker = start_worker(n_rollouts=n_rollouts)
        for start in range(0, len(stream), 150):
            assert producer.submit_steps(stream[start:start + 150], channel="train") == len(stream[start:start + 150])
    assert sum(end_offsets(bootstrap_servers, steps_topic("train", prefix))) == n_groups * n_rollouts * n_steps

    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        groups = fetch_groups(consumer, n_groups, timeout=180)
        settle_workers(bootstrap_servers, prefix, [worker])
        assert consumer.drain() == [], "a group arrived twice or unasked"

    assert len({g.prompt_uid for g in groups}) == n_groups
    for group in groups:
        expected = sorted(sent[group.prompt_uid], key=lambda s: (s.trajectory_uid, s.step_index))
        got = group.steps
        assert [(s.trajectory_uid, s.step_index) for s in got] == [(s.trajectory_uid, s.step_index) for s in expected]
        assert [s.prompt_ids for s in got] == [s.prompt_ids for s in expected]
        assert [s.response_ids for s in got] == [s.response_ids for s in expected]
        assert [s.reward for s in got] == [s.reward for s in expected]
        assert all(s.channel == "train" for s in got)
        assert group.n_rollouts == n_rollouts and group.status == "complete"
    ready_times = [g.ready_at for g in groups]
    assert ready_times == sorted(ready_times), "groups must arrive in the order they became ready"

    # The same steps through BatchConsumer.fetch_batch: a new consumer group replays the groups topic.
    with BatchConsumer("train", bootstrap_servers, prefix=prefix, group_id=f"{prefix}.second") as second:
        steps = second.fetch_batch(n_rollouts=n_rollouts, timeout=30)
        assert steps == groups[0].steps
        with pytest.raises(ValueError, match="n_rollouts"):
            second.fetch_batch(n_rollouts=3, timeout=30)


def test_trajectory_end_completes_groups_and_sets_reward(bootstrap_servers, prefix, start_worker):
    rng = random.Random(1)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        start_worker(n_rollouts=4)
        # Registered size 2 overrides the worker default of 4; no step says is_last.
        trajectories = group_steps("ended", 2, 2, rng, n_rollouts=2)
        for steps in trajectories:
            for step in steps:
                step.is_last = False
                step.reward = 0.0
        producer.submit_steps(interleave(trajectories, rng), channel="train")
        producer.complete_trajectory("ended/t0", "ended", reward=1.5, channel="train")
        producer.complete_trajectory("ended/t1", "ended", channel="train")

    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        steps = consumer.fetch_batch(timeout=60)
    assert steps is not None
    assert [(s.trajectory_uid, s.step_index, s.reward, s.is_last) for s in steps] == [
        ("ended/t0", 0, 0.0, False), ("ended/t0", 1, 1.5, True),
        ("ended/t1", 0, 0.0, False), ("ended/t1", 1, 0.0, True),
    ]


def test_garbage_goes_to_dlq_with_reason_while_valid_groups_arrive(bootstrap_servers, prefix, start_worker):
    rng = random.Random(3)
    topic = steps_topic("train", prefix)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        start_worker(n_rollouts=2)
        before, after = group_steps("before", 2, 2, rng), group_steps("after", 2, 2, rng)
        producer.submit_steps(interleave(before, rng), channel="train")
        raw = Producer({"bootstrap.servers": bootstrap_servers, "partitioner": "murmur2_random"})
        raw.produce(topic, key=b"before", value=b"\x00garbage that is no record")
        truncated = codec.encode(before[0][0])[:-3]
        raw.produce(topic, key=b"after", value=truncated)
        assert raw.flush(30) == 0
        raw.close()
        producer.submit_steps(interleave(after, rng), channel="train")

    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        received = sorted(g.prompt_uid for g in fetch_groups(consumer, 2, timeout=60))
    assert received == ["after", "before"]

    dead = read_topic(bootstrap_servers, dlq_topic(prefix), min_count=2, timeout=30)
    by_value = {m.value(): dict(m.headers()) for m in dead}
    garbage = by_value[b"\x00garbage that is no record"]
    assert garbage[REASON].startswith(b"undecodable: bad magic")
    assert garbage[SOURCE_TOPIC] == topic.encode() and int(garbage[SOURCE_OFFSET]) >= 0
    assert by_value[truncated][REASON].startswith(b"undecodable: truncated")
    assert {m.key() for m in dead} == {b"before", b"after"}


def test_producer_refuses_bad_input_and_sends_nothing(bootstrap_servers, prefix):
    good = Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p")
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        cases = [
            ([good, {"prompt_ids": [1], "response_ids": [2], "trajectory_uid": "t"}], "train", "^prompt_uid: "),
            ([good, {**good.__dict__, "step_index": -1}], "train", "^step_index: "),
            ([good, {**good.__dict__, "response_ids": [1.5]}], "train", r"^response_ids\[0\]: "),
            ([good], "no such channel", "^channel: "),
            ([Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p", channel="val")],
             "train", "^channel: "),
        ]
        for steps, channel, match in cases:
            with pytest.raises(ValueError, match=match):
                producer.submit_steps(steps, channel=channel)
        with pytest.raises(ValueError, match="^channel: "):
            producer.complete_trajectory("t", "p", channel="UPPER")
    assert sum(end_offsets(bootstrap_servers, steps_topic("train", prefix))) == 0
