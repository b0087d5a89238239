"""Replication rules: topics follow the cluster unless told otherwise; what a cluster cannot hold is refused."""

from __future__ import annotations

import pytest

from trajbus.infra.kafka_cluster import cluster_properties
from trajbus.infra.topics import CLUSTER_DEFAULT, ReplicationError, TopicSpec, _check_replication
from trajbus.pipelines.broker_command import BrokerUsageError, check_nodes
from trajbus.streams.client.topic_settings import TopicSettings


def test_topics_take_the_cluster_default_unless_set():
    for spec in TopicSettings().specs(["train"]):
        assert spec.replication_factor == CLUSTER_DEFAULT
        assert "min.insync.replicas" not in spec.config
    for spec in TopicSettings(replication_factor=3, min_insync_replicas=2).specs(["train"]):
        assert spec.replication_factor == 3
        assert spec.config["min.insync.replicas"] == "2"


def test_a_table_changelog_is_compacted_and_replicated_like_the_rest():
    spec = TopicSettings(replication_factor=3).table_spec("app-assembly-changelog", 8)
    assert (spec.partitions, spec.replication_factor, spec.config["cleanup.policy"]) == (8, 3, "compact")


@pytest.mark.parametrize("settings, message", [
    ({"replication_factor": 2, "min_insync_replicas": 3}, "min_insync_replicas: 3 is above the replication factor 2"),
    ({"replication_factor": 0}, "replication_factor: must be a positive integer"),
    ({"min_insync_replicas": -1}, "min_insync_replicas: must be a positive integer"),
])
def test_impossible_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        TopicSettings(**settings)


def test_more_replicas_than_brokers_is_refused_naming_topic_and_numbers():
    specs = [TopicSpec("ok", 1, {}, 3), TopicSpec("p.steps.train", 8, {}, 5)]
    with pytest.raises(ReplicationError, match="topic p.steps.train: replication factor 5 needs 5 brokers, "
                                               "the cluster has 3 available"):
        _check_replication(None, specs, 3, 1.0)  # explicit factors: no broker is asked
    _check_replication(None, specs[:1], 3, 1.0)


def test_min_insync_above_an_explicit_factor_is_refused():
    with pytest.raises(ReplicationError, match="min.insync.replicas 3 is above its replication factor 2"):
        _check_replication(None, [TopicSpec("t", 1, {"min.insync.replicas": "3"}, 2)], 3, 1.0)


@pytest.mark.parametrize("nodes, replicas, in_sync", [(1, "1", "1"), (2, "2", "2"), (3, "3", "2"), (5, "3", "2")])
def test_the_embedded_cluster_is_configured_as_managed_ones(nodes, replicas, in_sync):
    properties = cluster_properties(nodes)
    assert properties["default.replication.factor"] == properties["offsets.topic.replication.factor"] == replicas
    assert properties["min.insync.replicas"] == properties["transaction.state.log.min.isr"] == in_sync


@pytest.mark.parametrize("nodes", [0, 10, -1])
def test_nodes_out_of_range_are_refused(nodes):
    with pytest.raises(BrokerUsageError, match=f"--nodes: {nodes} is out of range"):
        check_nodes(nodes)
    assert check_nodes(3) == 3
