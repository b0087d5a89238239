"""trajbus on a replicated cluster: the embedded 3-node cluster, configured as managed ones are
(replication 3, min.insync.replicas 2, acks=all).

One cluster serves the module. Each fault test runs the real path under load: a
``StepProducer`` submitting two-rollout groups one acknowledged call at a time, a worker
process, a ``BatchConsumer`` trainer. Whatever the fault, every group the broker
acknowledged reaches the trainer exactly once and the worker process keeps running.
After each test every node runs again and every partition is fully replicated.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Iterator

import pytest
from confluent_kafka.admin import AdminClient

from trajbus.consumers import BatchConsumer
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.kafka_cluster import EmbeddedCluster
from trajbus.infra.topics import ensure_topics
from trajbus.pipelines.processes import worker_process
from trajbus.pipelines.synthetic import group_steps
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.topics import dlq_topic, groups_topic, steps_topic
from trajbus.streams.worker.assembler import STATE_TABLE
from tests.helpers import end_offsets, flowing, read_to_end, wait_for
from tests.integration.test_verl_queue_crash import assert_trained_once, end_the_epoch, lines, mid_mini_batch, role

NODES = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    cluster = EmbeddedCluster(tmp_path_factory.mktemp("cluster"), nodes=NODES)
    cluster.start(fresh=True)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def servers(cluster: EmbeddedCluster) -> Iterator[str]:
    """The bootstrap list; after the test, nodes it stopped run again and replicas catch up."""
    yield cluster.bootstrap_servers()
    cluster.start()
    wait_for(lambda: fully_replicated(cluster.bootstrap_servers()), 120, "every partition in sync on every node")


def fully_replicated(servers: str) -> bool:
    admin = AdminClient({"bootstrap.servers": servers, "log_level": 0})
    metadata = admin.list_topics(timeout=10)
    return len(metadata.brokers) == NODES and all(
        len(p.isrs) == len(p.replicas) and p.leader >= 0
        for topic in metadata.topics.values() for p in topic.partitions.values())


def replicas_of(servers: str, topic: str) -> set[int]:
    """The replica counts of a topic's partitions."""
    admin = AdminClient({"bootstrap.servers": servers, "log_level": 0})
    return {len(p.replicas) for p in admin.list_topics(topic, timeout=10).topics[topic].partitions.values()}


def leader_of(servers: str, topic: str, partition: int = 0) -> int:
    admin = AdminClient({"bootstrap.servers": servers, "log_level": 0})
    return admin.list_topics(topic, timeout=10).topics[topic].partitions[partition].leader


def kill(node: EmbeddedKafka) -> None:
    os.kill(node.read_state().pid, signal.SIGKILL)
    wait_for(lambda: node.status() is None, 30, f"node {node.node.node_id} to die")


def test_topics_take_the_cluster_replication(servers: str, prefix: str):
    settings = TopicSettings(prefix=prefix)
    ensure_topics(servers, settings.specs(["train"]))
    names = [spec.name for spec in settings.specs(["train"])]
    # A node learns of a new topic a moment after the controller: ask until the answer has them all.
    wait_for(lambda: all(replicas_of(servers, name) == {NODES} for name in names), 30,
             f"{NODES} replicas of every topic")


def test_a_node_lost_for_good(cluster: EmbeddedCluster, servers: str, prefix: str, tmp_path: Path):
    """A node SIGKILLed for good mid-run: the worker keeps running, the trainer keeps fetching; then a
    worker started while the node is still down runs and assembles."""
    worker = worker_process(servers, prefix, tmp_path / "worker.log", n_rollouts=2)
    try:
        with flowing(servers, prefix, worker) as flow:
            flow.producer.provision("train")
            flow.receive_until(lambda: len(flow.received) >= 5, 120, "groups before the fault")
            changelog = f"{prefix}-worker-train-{STATE_TABLE}-changelog"  # the worker created it, not Faust
            assert replicas_of(servers, changelog) == {NODES}, changelog
            victim = leader_of(servers, groups_topic("train", prefix))  # the node that leads the trainer's log
            kill(cluster.node(victim))
            flow.more_acked(15)
            flow.receive_until(lambda: len(flow.received) >= 10, 120, "groups after the fault")
            flow.finish()
        assert worker.alive(), f"the worker died:\n{worker.log_tail()}"
    finally:
        worker.stop()
    successor = worker_process(servers, prefix, tmp_path / "successor.log", n_rollouts=2)
    try:
        with flowing(servers, prefix, successor, "successor") as flow:
            flow.receive_until(lambda: len(flow.received) >= 5, 120, "groups through a worker started meanwhile")
            flow.finish()
        assert successor.alive(), f"the worker died:\n{successor.log_tail()}"
    finally:
        successor.stop()


def coordinator_of(servers: str, group_id: str) -> int:
    """The node that coordinates a consumer group."""
    admin = AdminClient({"bootstrap.servers": servers, "log_level": 0})
    return admin.describe_consumer_groups([group_id])[group_id].result(timeout=30).coordinator.id


def test_a_training_loop_rides_through_the_death_of_its_groups_coordinator(cluster: EmbeddedCluster, servers: str,
                                                                             prefix: str, tmp_path: Path):
    """Three rounds: the node that coordinates the trainer's consumer group is SIGKILLed while the loop fetches
    and commits after each group, then started again. The loop sees no exception (a commit the coordinator's
    move fails is retried; one the group refuses for a lost member is made once the consumer rejoined), every
    acknowledged group is trained exactly once, and the worker keeps running."""
    worker = worker_process(servers, prefix, tmp_path / "worker.log", n_rollouts=2)
    try:
        with flowing(servers, prefix, worker) as flow:
            for round_ in range(3):
                flow.receive_until(lambda: len(flow.received) >= 6 * round_ + 3, 120, "groups before the kill",
                                   commit=True)
                victim = cluster.node(coordinator_of(servers, flow.trainer.group_id))
                kill(victim)
                flow.more_acked(3)
                flow.receive_until(lambda: len(flow.received) >= 6 * round_ + 6, 120, "groups after the kill",
                                   commit=True)
                victim.start()
                wait_for(lambda: fully_replicated(servers), 120, "the coordinator's node back in sync")
            flow.finish()
        assert worker.alive(), f"the worker died:\n{worker.log_tail()}"
    finally:
        worker.stop()


def test_a_rolling_restart_loses_and_repeats_nothing(cluster: EmbeddedCluster, servers: str, prefix: str,
                                                     tmp_path: Path):
    worker = worker_process(servers, prefix, tmp_path / "worker.log", n_rollouts=2)
    try:
        with flowing(servers, prefix, worker) as flow:  # the worker starts before any topic exists
            flow.receive_until(lambda: len(flow.received) >= 3, 120, "groups before the restarts")
            for node in cluster.nodes():  # as an upgrade does: SIGTERM, start, wait until in sync
                node.stop()
                flow.more_acked(3)
                node.start()
                wait_for(lambda: fully_replicated(servers), 120, f"node {node.node.node_id} back in sync")
            flow.more_acked(3)
            flow.finish()
        assert sum(end_offsets(servers, dlq_topic(prefix))) == 0, "records went to the DLQ"
        assert worker.alive(), f"the worker died:\n{worker.log_tail()}"
    finally:
        worker.stop()


def test_the_verl_queue_loses_nothing_when_its_leader_dies(cluster: EmbeddedCluster, servers: str, prefix: str,
                                                          tmp_path: Path):
    """verl's queue on trajbus across the samples partition's leader SIGKILLed mid-flow, then the trainer
    kill -9ed mid-mini-batch and resumed: every sample put is trained once."""
    rollouter = role("rollouter", servers, prefix, tmp_path, "--first", "0", "--count", "400", "--seconds", "0.1")
    trainer = role("trainer", servers, prefix, tmp_path)
    try:
        wait_for(lambda: lines(trainer, "checkpoint") or None, 180, "a first checkpoint")
        kill(cluster.node(leader_of(servers, f"{prefix}.verl.crash.run")))
        put_before = len(lines(rollouter, "put"))
        wait_for(lambda: len(lines(rollouter, "put")) >= put_before + 8 and mid_mini_batch(trainer, 4), 180,
                 "puts after the leader's death and the trainer mid-mini-batch")
        trainer.kill()
        end_the_epoch(servers, prefix, tmp_path, rollouter)
    finally:
        rollouter.kill()
        trainer.kill()
    assert_trained_once(servers, prefix, tmp_path)


def test_four_ranks_read_disjoint_shares(servers: str, prefix: str, tmp_path: Path):
    ranks = 4
    ensure_topics(servers, TopicSettings(prefix=prefix, groups_partitions=ranks).specs(["train"]))
    worker = worker_process(servers, prefix, tmp_path / "worker.log", n_rollouts=2,
                            extra=["--groups-partitions", str(ranks)])
    rng = random.Random(5)
    sent = [f"rank-{number:03d}" for number in range(40)]
    consumers = [BatchConsumer("train", servers, prefix=prefix, rank=r, world_size=ranks) for r in range(ranks)]
    got: dict[int, list[str]] = {r: [] for r in range(ranks)}
    try:
        worker.start()
        with StepProducer(servers, prefix=prefix) as producer:
            for uid in sent:  # one acknowledged call per group
                producer.submit_steps([s for t in group_steps(uid, 2, 2, rng) for s in t], channel="train")

        def fetch_round() -> bool:
            for rank, consumer in enumerate(consumers):
                group = consumer.fetch_group(0.2)
                if group is not None:
                    assert len(group.trajectory_uids) == 2, "a prompt group was split"
                    got[rank].append(group.prompt_uid)
            return sum(map(len, got.values())) >= len(sent)
        wait_for(fetch_round, 120, "every group at some rank", interval=0)
        everything = [uid for uids in got.values() for uid in uids]
        assert sorted(everything) == sorted(sent), "a group was lost or read by two ranks"
        total = sum(len(m.value()) for m in read_to_end(servers, groups_topic("train", prefix)))
        shares = [consumer.fetched_bytes / total for consumer in consumers]
        assert abs(sum(shares) - 1.0) < 1e-9, f"ranks fetched {shares} of the topic's bytes, not each a share"
        assert all(0 < share < 0.4 for share in shares), f"a rank fetched {max(shares):.2f} of the topic"
        for consumer in consumers:
            assert consumer.partitions is not None and len(consumer.partitions) == 1

        # A rank restarted from its checkpoint resumes after the last group it handed out.
        rank0 = consumers[0]
        rank0.load_state_dict({"topic": rank0.topic, "group_id": rank0.group_id, "positions": {0: 0}})
        first = [rank0.fetch_group(30).prompt_uid for _ in range(2)]
        checkpoint = rank0.state_dict()
        rank0.fetch_group(30)  # trained after the checkpoint, then the process dies
        with BatchConsumer("train", servers, prefix=prefix, rank=0, world_size=ranks) as restarted:
            restarted.load_state_dict(checkpoint)
            assert restarted.fetch_group(30).prompt_uid == got[0][2]
        assert first == got[0][:2], "a rank's groups are not FIFO"
    finally:
        for consumer in consumers:
            consumer.close()
        worker.stop()


def leaders(servers: str, topic: str) -> dict[int, int]:
    """Partition -> the node leading it (-1: none yet)."""
    admin = AdminClient({"bootstrap.servers": servers, "log_level": 0})
    return {p: meta.leader for p, meta in admin.list_topics(topic, timeout=10).topics[topic].partitions.items()}


def elected(servers: str, topic: str) -> int:
    """The node leading the topic's partition 0, once one does (an election may be under way)."""
    return wait_for(lambda: max(leader_of(servers, topic), 0), 30, f"a leader of {topic}[0]")


def test_the_leaders_hard_bounced_five_times_lose_and_repeat_nothing(cluster: EmbeddedCluster, servers: str,
                                                                     prefix: str, tmp_path: Path):
    """ducktape's hard bounce under load: the node leading the groups partition and a steps partition is
    SIGKILLed and started again at once, five times in a row, each time the node leading them then (a
    groups leader that leads no steps partition is bounced, then steps partition 0's leader). Every
    acknowledged group arrives, none twice, none in the DLQ."""
    worker = worker_process(servers, prefix, tmp_path / "worker.log", n_rollouts=2)
    steps, groups = steps_topic("train", prefix), groups_topic("train", prefix)
    try:
        with flowing(servers, prefix, worker) as flow:
            flow.receive_until(lambda: len(flow.received) >= 3, 120, "groups before the bounces")
            for _ in range(5):
                victim = elected(servers, groups)
                leads_steps = victim in leaders(servers, steps).values()
                victims = [victim] if leads_steps else [victim, elected(servers, steps)]
                for node_id in victims:
                    kill(cluster.node(node_id))
                    cluster.node(node_id).start()
                    flow.more_acked(2)  # the cluster takes writes again before the next bounce
            flow.finish()
        assert sum(end_offsets(servers, dlq_topic(prefix))) == 0, "records went to the DLQ"
        assert worker.alive(), f"the worker died:\n{worker.log_tail()}"
    finally:
        worker.stop()
