"""Test helpers: synthetic prompt groups, waiting on conditions with deadlines, reading topics."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from trajbus.consumers import BatchConsumer
from trajbus.consumers.assignment import describe_group
from trajbus.infra.local import free_ports
from trajbus.pipelines.processes import (ServiceProcess, gateway_process, scripted_engine_process, wait_http,
                                         worker_process)
from trajbus.pipelines.synthetic import group_steps
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import PrefixResolver, StepDelta
from trajbus.streams.client.producer import DeliveryError, StepProducer
from trajbus.streams.wire.records import ReadyGroup, Step, TrajectoryEnd

T = TypeVar("T")


@contextlib.contextmanager
def agent_stack(bootstrap_servers: str, prefix: str, channels: tuple[str, ...], model_dir: object, logs: object,
                replies: list, gateway_args: list[str], record: object = None) -> Iterator[tuple[str, int]]:
    """A scripted engine (8 generations at once; ``record``: the file it writes every prompt to), a stream
    worker for ``channels`` (none without channels: one already serves them) and a gateway at the engine, all
    started at once (the gateway is ready once the engine answers) and stopped at once; yields the gateway's
    URL and the engine's port. The channels' topics are provisioned first."""
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        for channel in channels:
            producer.provision(channel)
    engine_port = free_ports(2)  # two ports, distinct (two free_port() calls can draw the same one)
    gateway_port = engine_port + 1
    started = [scripted_engine_process(engine_port, logs, model_dir, replies, record=record, workers=8).start()]
    if channels:
        started.append(worker_process(bootstrap_servers, prefix, logs / "worker.log",
                                      channels=",".join(channels)).start())
    started.append(gateway_process(bootstrap_servers, prefix, [f"127.0.0.1:{engine_port}"], model_dir,
                                   gateway_port, logs / "gateway-state", logs / "gateway.log", gateway_args).start())
    try:
        wait_http(f"http://127.0.0.1:{gateway_port}/ready", 120, started[-1])
        yield f"http://127.0.0.1:{gateway_port}", engine_port
    finally:
        for process in started:  # all stop at once, then each is waited for
            if process.alive():
                process.process.send_signal(signal.SIGTERM)
        for process in started:
            process.stop()


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
    quiet = {"logger": logging.getLogger("tests.kafka")}  # librdkafka's lines through logging, never raw stderr
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **quiet})
    partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "tests.read_topic",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 50, "auto.offset.reset": "earliest",
                         **quiet})
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



def decode_step_events(messages: list[Message]) -> list[Step | TrajectoryEnd]:
    """Step events read from their partitions' start, each step with its whole prompt (schema v2
    may store it as a reference to the trajectory's step before)."""
    resolver = PrefixResolver()
    records = [codec.decode(m.value()) for m in messages]
    return [resolver.resolve(r) if isinstance(r, (Step, StepDelta)) else r for r in records]


def read_to_end(bootstrap_servers: str, topic: str, timeout: float = 30.0) -> list[Message]:
    """Every record of ``topic`` up to its current end."""
    from trajbus.infra.topics import describe_topics

    total = describe_topics(bootstrap_servers, names=[topic])[0].records
    return read_topic(bootstrap_servers, topic, min_count=total, timeout=timeout)


def end_offsets(bootstrap_servers: str, topic: str) -> list[int]:
    from trajbus.infra.topics import describe_topics

    return describe_topics(bootstrap_servers, names=[topic])[0].end_offsets


def trajbus(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the `trajbus` CLI as a user would, capturing its output."""
    return subprocess.run([sys.executable, "-m", "trajbus.pipelines.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def audit_report(bootstrap_servers: str, prefix: str, channel: str = "train", *extra: str) -> tuple[int, dict]:
    """``trajbus audit --json`` of a channel: (exit code, report)."""
    import json

    run = trajbus("audit", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--channel", channel,
                  "--json", *extra)
    assert run.returncode in (0, 1), run.stderr
    return run.returncode, json.loads(run.stdout)


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


def settle_workers(bootstrap_servers: str, prefix: str, workers: list, channels: tuple[str, ...] = ("train",),
                   timeout: float = 60.0) -> None:
    """Wait until the running workers have applied every step (their published source positions
    reach the steps topics' ends), then stop them gracefully: whatever the groups topics hold
    afterwards is all they will ever emit (a known end, no sleeping)."""
    from trajbus.streams.wire.stats import applied_positions
    from trajbus.streams.client.snapshots import read_snapshots
    from trajbus.streams.wire.topics import steps_topic

    def applied_everything() -> bool:
        positions = applied_positions(read_snapshots(bootstrap_servers, prefix), {w.pid for w in workers})
        return all(positions.get((channel, partition), 0) >= end
                   for channel in channels
                   for partition, end in enumerate(end_offsets(bootstrap_servers, steps_topic(channel, prefix))))

    wait_for(applied_everything, timeout, f"the workers to apply every step of {channels}", interval=0.5)
    for worker in workers:
        assert worker.stop() == 0, f"the worker did not stop cleanly:\n{worker.log_tail()}"


def assert_exactly_the_groups_sent(groups: list[ReadyGroup], sent: dict[str, list[Step]]) -> None:
    """Every sent group once, each complete with its steps in (trajectory_uid, step_index) order."""
    uids = [g.prompt_uid for g in groups]
    assert len(uids) == len(set(uids)), f"{len(uids) - len(set(uids))} groups arrived twice"
    assert set(uids) == set(sent)
    for group in groups:
        expected = sorted(sent[group.prompt_uid], key=lambda s: (s.trajectory_uid, s.step_index))
        assert [(s.trajectory_uid, s.step_index, s.prompt_ids, s.response_ids, s.reward) for s in group.steps] == \
            [(s.trajectory_uid, s.step_index, s.prompt_ids, s.response_ids, s.reward) for s in expected]


def through_worker(bootstrap_servers: str, prefix: str, start_worker: Callable, steps: list[Step],
                   n_rollouts: int, channel: str = "train") -> None:
    """Provision the channel, start a worker, and submit ``steps`` (acknowledged)."""
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision(channel)
        start_worker(n_rollouts=n_rollouts)
        producer.submit_steps(steps, channel=channel)


def submit_until_stopped(producer: StepProducer, acked: dict[str, int], stop: threading.Event,
                         name: str = "load") -> None:
    """Load: one two-rollout group after another; a group counts once the broker acknowledged all of it."""
    rng = random.Random(11)
    number = 0
    while not stop.is_set():
        uid = f"{name}-{number:04d}"
        steps = [s for trajectory in group_steps(uid, 2, 2, rng) for s in trajectory]
        try:
            producer.submit_steps(steps, channel="train")
            acked[uid] = len(steps)
        except DeliveryError:  # the broker is down: its fate is unknown, it may still land
            pass
        number += 1


class Flow:
    """Acknowledged load in, the trainer's groups out, counted by prompt uid."""

    def __init__(self, producer: StepProducer, trainer: BatchConsumer, name: str) -> None:
        self.producer, self.trainer = producer, trainer
        self.acked: dict[str, int] = {}
        self.received: list[str] = []
        self.stop = threading.Event()
        self.load = threading.Thread(target=submit_until_stopped, args=(producer, self.acked, self.stop, name))

    def receive_until(self, done, timeout: float, what: str, commit: bool = False) -> None:
        """Fetch until ``done()``; ``commit``: after each group, as a training loop does after its step."""
        def step() -> bool:
            group = self.trainer.fetch_group(1.0)
            if group is not None:
                self.received.append(group.prompt_uid)
                if commit:
                    self.trainer.commit()
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


def trainer_state(servers: str, trainer: BatchConsumer) -> str:
    """What a trainer that received nothing stands on: its assignment, and its group as the coordinator sees it."""
    assignment = [(tp.partition, tp.offset) for tp in trainer._consumer.assignment()]
    try:
        group = describe_group(servers, trainer.group_id)
        seen = (f"group {group.state}, coordinator {group.coordinator.id}, members "
                f"{[[tp.partition for tp in m.assignment.topic_partitions] for m in group.members]}")
    except Exception as exc:  # the evidence is best effort: the cluster may not answer either
        seen = f"group not described: {exc!r}"
    return f"assigned {assignment}, positions {trainer._positions}, received {trainer.fetched_bytes} bytes; {seen}"


@contextlib.contextmanager
def flowing(servers: str, prefix: str, worker: ServiceProcess | None, name: str = "load",
            call_timeout: float = 60) -> Iterator[Flow]:
    """A producer under load (each call waits up to ``call_timeout`` s for its acknowledgement) and a
    trainer, with ``worker`` started between them; the load stops on the way out."""
    with StepProducer(servers, prefix=prefix, timeout=call_timeout) as producer, \
            BatchConsumer("train", servers, prefix=prefix) as trainer:
        flow = Flow(producer, trainer, name)
        try:
            if worker is not None:
                worker.start()
            flow.load.start()
            yield flow
        except AssertionError as exc:  # a wait that timed out: what the worker said is the evidence
            if worker is None:
                raise
            raise AssertionError(f"{exc}\n--- the trainer: {trainer_state(servers, trainer)}\n"
                                 f"--- the worker's log, last lines:\n{worker.log_tail(60)}") from None
        finally:
            flow.stop.set()
            if flow.load.is_alive():
                flow.load.join(120)
