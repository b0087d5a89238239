"""The wire's small records without a broker: group headers, policy versions, statistics snapshots."""

from __future__ import annotations

import time

import pytest

from trajbus.streams.wire import dlq, headers, policy, stats


def test_a_group_names_its_source_and_a_record_without_both_headers_names_none():
    named = dict(headers.source_headers(3, 41))
    assert named == {headers.SOURCE_PARTITION: b"3", headers.SOURCE_OFFSET: b"41"}
    assert headers.source_of(named) == (3, 41)
    assert headers.source_of({headers.SOURCE_PARTITION: b"3"}) is None and headers.source_of({}) is None


def test_traceparents_round_trip_and_a_malformed_value_names_none():
    parents = {"g/t0": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    assert headers.decode_traceparents(headers.encode_traceparents(parents)) == parents
    for bad in (None, b"", b"{not json", b"[1, 2]"):
        assert headers.decode_traceparents(bad) == {}


def test_dead_letter_headers_follow_the_original_ones():
    named = dlq.dlq_headers({"content-type": b"x"}, "undecodable: bad", "p.steps.train", 2, 9)
    assert named[0] == ("content-type", b"x")
    assert dict(named[1:])[dlq.SOURCE_OFFSET] == b"9" and dict(named)[dlq.REASON] == b"undecodable: bad"


def test_a_channel_takes_its_own_key_else_global_and_the_engines_their_serving_key_else_the_trainers():
    assert policy.policy_key("train") == "train" and policy.policy_key("train", serving=True) == "serving.train"
    versions = {"global": 3, "val": 5}
    assert (policy.trainer_version(versions, "train"), policy.trainer_version(versions, "val")) == (3, 5)
    assert policy.serving_version(versions, "train") == 3, "no serving key: engines serve the trainer's"
    versions["serving.global"] = 2
    assert policy.serving_version(versions, "val") == 2
    assert policy.trainer_version({}, "train") is None
    assert policy.decode_policy_version(policy.encode_policy_version(7)) == 7
    with pytest.raises(ValueError):
        policy.decode_policy_version(b'{"version": "7"}')


def test_counters_add_up_over_every_snapshot_and_gauges_over_live_ones():
    sample = lambda name, value: [name, {"channel": "train"}, value]  # noqa: E731
    live = stats.snapshot_of("w1", [sample("trajbus_worker_trajectories_completed_total", 2),
                                    sample("trajbus_worker_pending_groups", 4)])
    stopped = stats.snapshot_of("w2", [sample("trajbus_worker_trajectories_completed_total", 5),
                                       sample("trajbus_worker_pending_groups", 9)], stopped=True)
    assert stats.decode_snapshot(stats.encode_snapshot(live)) == live
    assert stats.is_live(live, time.time()) and not stats.is_live(stopped, time.time())
    assert stats.summarize([live, stopped])["train"] == {"trajectories_completed": 7, "pending_groups": 4}
