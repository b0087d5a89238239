"""trajbus on a replicated cluster: the embedded 3-node cluster, configured as managed ones are
(replication 3, min.insync.replicas 2, acks=all).

One cluster serves the module. Each fault test runs the real path under load: a
``StepProducer`` submitting two-rollout groups one acknowledged call at a time, a worker
process, a ``BatchConsumer`` trainer. Whatever the fault, every group the broker
acknowledged reaches the trainer exactly once and the worker process keeps running.
After each test every node runs again and every partition is fully replicated.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Iterator

import pytest
from confluent_kafka.admin import AdminClient

from trajbus.consumers import BatchConsumer
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.kafka_cluster import EmbeddedCluster
from trajbus.infra.topics import ensure_topics
from trajbus.pipelines.processes import ServiceProcess, worker_process
from trajbus.streams.producer import StepProducer
from trajbus.streams.topics import TopicSettings, dlq_topic, groups_topic
from tests.helpers import end_offsets, submit_until_stopped, wait_for

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


def leader_of(servers: str, topic: str, partition: int = 0) -> int:
    admin = AdminClient({"bootstrap.servers": servers, "log_level": 0})
    return admin.list_topics(topic, timeout=10).topics[topic].partitions[partition].leader


def kill(node: EmbeddedKafka) -> None:
    os.kill(node.read_state().pid, signal.SIGKILL)
    wait_for(lambda: node.status() is None, 30, f"node {node.node.node_id} to die")


class Flow:
    """Acknowledged load in, the trainer's groups out, counted by prompt uid."""

    def __init__(self, producer: StepProducer, trainer: BatchConsumer, name: str) -> None:
        self.producer, self.trainer = producer, trainer
        self.acked: dict[str, int] = {}
        self.received: list[str] = []
        self.stop = threading.Event()
        self.load = threading.Thread(target=submit_until_stopped, args=(producer, self.acked, self.stop, name))

    def receive_until(self, done, timeout: float, what: str) -> None:
        def step() -> bool:
            group = self.trainer.fetch_group(1.0)
            if group is not None:
                self.received.append(group.prompt_uid)
            return done()
        wait_for(step, timeout, what, interval=0)

    def more_acked(self, count: int, timeout: float = 120) -> None:
        before = len(self.acked)
        wait_for(lambda: len(self.acked) >= before + count, timeout, f"{count} more acknowledged groups")

    def finish(self) -> None:
        """Stop the load, then receive until every acknowledged group arrived; none twice."""
        self.stop.set()
        self.load.join(120)
        try:
            self.receive_until(lambda: set(self.acked) <= set(self.received), 180, "every acknowledged group")
        except AssertionError as exc:
            missing = sorted(set(self.acked) - set(self.received))
            raise AssertionError(f"{exc}: {len(missing)} of {len(self.acked)} acknowledged never arrived: "
                                 f"{missing[:10]}") from None
        assert len(self.received) == len(set(self.received)), "a group arrived twice"


@contextlib.contextmanager
def flowing(servers: str, prefix: str, worker: ServiceProcess | None, name: str = "load") -> Iterator[Flow]:
    with StepProducer(servers, prefix=prefix, timeout=60) as producer, \
            BatchConsumer("train", servers, prefix=prefix) as trainer:
        flow = Flow(producer, trainer, name)
        try:
            if worker is not None:
                worker.start()
            flow.load.start()
            yield flow
        finally:
            flow.stop.set()
            if flow.load.is_alive():
                flow.load.join(120)


def test_topics_take_the_cluster_replication(servers: str, prefix: str):
    settings = TopicSettings(prefix=prefix)
    ensure_topics(servers, settings.specs(["train"]))
    admin = AdminClient({"bootstrap.servers": servers, "log_level": 0})
    topics = admin.list_topics(timeout=10).topics
    for spec in settings.specs(["train"]):
        assert {len(p.replicas) for p in topics[spec.name].partitions.values()} == {NODES}, spec.name


def test_a_node_lost_for_good(cluster: EmbeddedCluster, servers: str, prefix: str, tmp_path: Path):
    worker = worker_process(servers, prefix, tmp_path / "worker.log", n_rollouts=2)
    try:
        with flowing(servers, prefix, worker) as flow:
            flow.producer.provision("train")
            flow.receive_until(lambda: len(flow.received) >= 5, 120, "groups before the fault")
            victim = leader_of(servers, groups_topic("train", prefix))  # the node that leads the trainer's log
            kill(cluster.node(victim))
            flow.more_acked(15)
            flow.receive_until(lambda: len(flow.received) >= 10, 120, "groups after the fault")
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


def test_a_worker_started_while_a_node_is_down_assembles(cluster: EmbeddedCluster, servers: str, prefix: str,
                                                         tmp_path: Path):
    first = worker_process(servers, prefix, tmp_path / "first.log", n_rollouts=2)
    try:  # a worker ran once: its topics, the changelog too, exist with three replicas
        with flowing(servers, prefix, first, "first") as flow:
            flow.receive_until(lambda: len(flow.received) >= 2, 120, "groups through the first worker")
            flow.finish()
    finally:
        first.stop()
    kill(cluster.node(1))  # the first address of the bootstrap list
    second = worker_process(servers, prefix, tmp_path / "second.log", n_rollouts=2)
    try:
        with flowing(servers, prefix, second, "second") as flow:
            flow.receive_until(lambda: len(flow.received) >= 5, 120, "groups through the second worker")
            flow.finish()
        assert second.alive(), f"the worker died:\n{second.log_tail()}"
    finally:
        second.stop()
