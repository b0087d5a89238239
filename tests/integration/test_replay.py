"""Replay of a channel's history: windows by time and offset, policy versions, a new channel, the live group."""

from __future__ import annotations

import random
import time

import pytest

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.replay import Replay, ReplayError
from trajbus.infra.group_lag import consumer_group_lag
from trajbus.infra.topics import delete_records_before
from trajbus.pipelines.synthetic import group_steps
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.topics import groups_topic, trainer_group_id
from tests.helpers import fetch_groups, settle_workers, trajbus


def run_versions(bootstrap_servers, prefix, start_worker, versions=(1, 2, 3), per_version=4):
    """Groups of each policy version through the worker and a live trainer.

    Returns the uids of each version and two windows per version (unix seconds, end exclusive):
    its steps' explicit creation times (the steps topic's record timestamps: version v is
    created at ``BASE + 10 v`` s) and the ready times the worker stamped on its groups."""
    rng = random.Random(5)
    base = time.time() - 600
    uids: dict[int, list[str]] = {}
    created: dict[int, tuple[float, float]] = {}
    ready: dict[int, tuple[float, float]] = {}
    with StepProducer(bootstrap_servers, prefix=prefix) as producer, \
            BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:
        producer.provision("train")
        start_worker(n_rollouts=2)
        for version in versions:
            uids[version] = []
            for g in range(per_version):
                uid = f"v{version}-g{g}"
                steps = [s for t in group_steps(uid, 2, 2, rng, policy_version=version) for s in t]
                for step in steps:
                    step.created_at = base + 10 * version + 0.1 * g
                producer.submit_steps(steps, channel="train")
                uids[version].append(uid)
            got = fetch_groups(trainer, per_version, timeout=120)  # the live trainer consumes and commits
            trainer.commit()
            assert {g.prompt_uid for g in got} == set(uids[version])
            created[version] = (base + 10 * version, base + 10 * version + 5)
            ready[version] = (min(g.ready_at for g in got), max(g.ready_at for g in got) + 0.001)
    return uids, created, ready


def read_channel(bootstrap_servers, prefix, channel, count, workers=()):
    """The ``count`` groups of ``channel``, and nothing after them up to the topic's end
    (``workers`` assembling the channel are settled first)."""
    with BatchConsumer(channel, bootstrap_servers, prefix=prefix) as consumer:
        groups = fetch_groups(consumer, count, timeout=60)
        if workers:
            settle_workers(bootstrap_servers, prefix, list(workers), channels=(channel,))
        assert consumer.drain() == [], "more groups than the window holds"
    return groups


def test_replay_version_2_by_time_window_into_a_new_channel_twice(bootstrap_servers, prefix, start_worker):
    uids, _, marks = run_versions(bootstrap_servers, prefix, start_worker)
    live = trainer_group_id("train", prefix)
    committed = [p.committed for p in consumer_group_lag(bootstrap_servers, live, groups_topic("train", prefix))]
    start, end = marks[2]
    with Replay("train", bootstrap_servers, prefix=prefix) as everything:
        emitted_order = [g.prompt_uid for g in everything.groups()]  # the groups topic's order
    expected = [u for u in emitted_order if u in uids[2]]
    results = []
    for target in ("v2_first", "v2_second"):
        with Replay("train", bootstrap_servers, prefix=prefix, start_time=start, end_time=end,
                    policy_versions={2}) as replay:
            assert replay.into_channel(target) == 4
        groups = read_channel(bootstrap_servers, prefix, target, 4)
        assert all(s.policy_version == 2 for g in groups for s in g.steps)
        assert all(g.channel == target for g in groups)
        results.append([(g.prompt_uid, [(s.trajectory_uid, s.step_index, s.response_ids) for s in g.steps])
                        for g in groups])
    assert [uid for uid, _ in results[0]] == expected, "exactly the version-2 groups, in order"
    assert results[0] == results[1], "the same window replays to the same groups"
    assert [p.committed for p in consumer_group_lag(bootstrap_servers, live, groups_topic("train", prefix))] == \
        committed, "replay must not move the live trainer's group"

    with Replay("train", bootstrap_servers, prefix=prefix, policy_versions={1, 3}) as replay:
        assert sorted(g.prompt_uid for g in replay.groups()) == sorted(uids[1] + uids[3])
    with Replay("train", bootstrap_servers, prefix=prefix, start_offset=4, end_offset=8) as replay:
        assert [g.prompt_uid for g in replay.groups()] == emitted_order[4:8]
    with Replay("train", bootstrap_servers, prefix=prefix, start_time=start, end_time=end,
                max_groups_per_s=100) as replay:  # straight to a trainer, as DataProto batches
        batches = list(replay.batches(n_groups=3, backend=VerlBackend(prompt_length=16, response_length=8)))
    assert [len(b) for b in batches] == [12, 4]  # 4 groups x 2 trajectories x 2 steps, rows per step
    assert [uid for b in batches for uid in dict.fromkeys(b.non_tensor_batch["uid"])] == expected


def test_replay_from_steps_reassembles_under_the_new_channels_settings(bootstrap_servers, prefix, start_worker):
    uids, marks, _ = run_versions(bootstrap_servers, prefix, start_worker, versions=(1, 2))
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("refiltered")
    refiltering = start_worker(channels="refiltered", n_rollouts=2,
                 extra=["--channel-setting", "refiltered.group_filter=tests.group_filters:keep_even"])
    with Replay("train", bootstrap_servers, prefix=prefix, source="steps", start_time=marks[2][0],
                end_time=marks[2][1]) as replay:
        assert replay.into_channel("refiltered") == 4 * 2 * 2  # 4 groups x 2 trajectories x 2 steps
    groups = read_channel(bootstrap_servers, prefix, "refiltered", 2, workers=[refiltering])
    assert sorted(g.prompt_uid for g in groups) == ["v2-g0", "v2-g2"], "history re-assembled under a new filter"
    assert all(len(g.steps) == 4 and g.steps[-1].policy_version == 2 for g in groups)


def test_bad_windows_are_named(bootstrap_servers, prefix, start_worker):
    uids, _, marks = run_versions(bootstrap_servers, prefix, start_worker, versions=(1,))
    with pytest.raises(ReplayError, match="the end .* is before the start"):
        Replay("train", bootstrap_servers, prefix=prefix, start_time=marks[1][1], end_time=marks[1][0])
    with pytest.raises(ReplayError, match="topic .*groups.nowhere does not exist"):
        Replay("nowhere", bootstrap_servers, prefix=prefix)
    delete_records_before(bootstrap_servers, groups_topic("train", prefix), 0, 2)
    with pytest.raises(ReplayError, match="before the earliest retained data"):
        Replay("train", bootstrap_servers, prefix=prefix, start_time=marks[1][0] - 60)
    with pytest.raises(ReplayError, match="before the earliest retained offset 2"):
        Replay("train", bootstrap_servers, prefix=prefix, start_offset=0)

    common = ["--bootstrap-servers", bootstrap_servers, "--prefix", prefix]
    for args, says in [(["--channel", "train", "--from", "200", "--to", "100"], "is before the start"),
                       (["--channel", "nowhere"], "does not exist"),
                       (["--channel", "train", "--from", "yesterday"], "neither unix seconds nor an ISO 8601"),
                       (["--channel", "train", "--source", "steps"], "--into")]:
        result = trajbus("replay", *args, *common)
        assert result.returncode == 2 and says in result.stderr, (args, result.stderr)
    listed = trajbus("replay", "--channel", "train", "--from-offset", "2", *common)
    assert listed.returncode == 0 and "2 groups in the window" in listed.stdout
    assert "\r" not in listed.stdout + listed.stderr, "a progress line only on a terminal: not into a pipe or a log"
