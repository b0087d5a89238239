"""The stream processor against raw Kafka, on the same broker in the same run.

- Throughput: N steps (groups of 4 trajectories x 3 steps) produced and the
  resulting groups consumed, as steps/s, over raw produce-and-consume of the
  same encoded step bytes through a plain topic with the same partitions.
- Latency: for groups whose other steps are already in, the time from the last
  step's acknowledgement to the group being returned by ``fetch_group`` (p50, p99).

Uses TRAJBUS_BOOTSTRAP_SERVERS when set, else a throw-away embedded broker.
Prints a table and writes benchmarks/results/assembly.json.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Producer, TopicPartition

from trajbus.consumers import BatchConsumer
from trajbus.infra.clients import acked_producer, reader
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.topics import TopicSpec, ensure_topics
from trajbus.pipelines.processes import worker_process
from trajbus.streams.wire import codec
from trajbus.streams.client.producer import StepProducer
from trajbus.pipelines.synthetic import make_groups
from trajbus.pipelines.tables import print_table

log = logging.getLogger("trajbus.benchmarks")

RESULTS = Path(__file__).resolve().parent / "results"


def raw_round_trip(bootstrap: str, values: list[tuple[bytes, bytes]], partitions: int,
                   lanes: list[list[int]] | None = None) -> float:
    """Seconds to produce ``values`` (acknowledged: idempotent, acks=all, as trajbus's producers) and
    consume them all back through a plain topic of the cluster's replication. ``lanes``: indexes of
    ``values``, one thread each producing one record per call and waiting for its acknowledgement
    (the gateway's call pattern); else all produced at once, then flushed."""
    topic = f"bench-raw-{uuid.uuid4().hex[:6]}"
    ensure_topics(bootstrap, [TopicSpec(topic, partitions)])
    consumer = reader(bootstrap, {"fetch.wait.max.ms": 50, "logger": log})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    producer = acked_producer(bootstrap, {"linger.ms": 1, "compression.type": "lz4",
                                          "partitioner": "murmur2_random", "logger": log})
    start = time.perf_counter()
    if lanes is None:
        produce_all(producer, topic, values)
    else:
        produce_per_call(producer, topic, values, lanes)
    received, deadline = 0, time.monotonic() + 300
    while received < len(values):
        if time.monotonic() > deadline:
            raise RuntimeError(f"raw baseline: {received} of {len(values)} records consumed back in 300 s")
        message = consumer.poll(1.0)
        if message is not None and not message.error():
            received += 1
    elapsed = time.perf_counter() - start
    consumer.close()
    return elapsed


def produce_all(producer: Producer, topic: str, values: list[tuple[bytes, bytes]]) -> None:
    for key, value in values:
        while True:
            try:
                producer.produce(topic, key=key, value=value)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(60)


def produce_per_call(producer: Producer, topic: str, values: list[tuple[bytes, bytes]],
                     lanes: list[list[int]]) -> None:
    """Each lane a thread: one record per call, the next only once the broker acknowledged it; one
    thread serves every delivery report (as ``StepProducer`` does)."""
    polling = threading.Event()

    def serve_reports() -> None:
        while not polling.is_set():
            producer.poll(0.05)

    def call(key: bytes, value: bytes) -> None:
        acked = threading.Event()
        errors: list = []

        def report(err: Any, _message: Any) -> None:
            if err is not None:
                errors.append(err)
            acked.set()

        producer.produce(topic, key=key, value=value, on_delivery=report)
        if not acked.wait(60) or errors:
            raise RuntimeError(f"raw baseline: a call was not acknowledged: {errors or 'no report in 60 s'}")

    poller = threading.Thread(target=serve_reports, name="raw-baseline-poll", daemon=True)
    poller.start()
    try:
        with ThreadPoolExecutor(len(lanes)) as pool:
            list(pool.map(lambda lane: [call(*values[i]) for i in lane], lanes))
    finally:
        polling.set()
        poller.join()


def assembled_round_trip(bootstrap: str, prefix: str, steps: list, n_groups: int) -> float:
    """Seconds to submit ``steps`` (acknowledged) and fetch all ``n_groups`` ready groups."""
    with StepProducer(bootstrap, prefix=prefix) as producer, BatchConsumer("train", bootstrap,
                                                                           prefix=prefix) as consumer:
        consumer.fetch_group(timeout=1.0)  # join the group before the clock starts
        start = time.perf_counter()
        for first in range(0, len(steps), 500):
            producer.submit_steps(steps[first:first + 500], channel="train")
        fetched = 0
        while fetched < n_groups:
            if consumer.fetch_group(timeout=60) is None:
                raise RuntimeError(f"only {fetched} of {n_groups} groups arrived")
            fetched += 1
        return time.perf_counter() - start


def latencies(bootstrap: str, prefix: str, n_groups: int) -> list[float]:
    """Last-step acknowledgement to fetchable group, one group at a time, in seconds."""
    sent, _ = make_groups(n_groups, 4, 3, seed=2, tag="lat", window=1)
    result = []
    with StepProducer(bootstrap, prefix=prefix) as producer, BatchConsumer("train", bootstrap, prefix=prefix,
                                                                           group_id=f"{prefix}.latency") as consumer:
        for uid, steps in sorted(sent.items()):
            producer.submit_steps(steps[:-1], channel="train")
            producer.submit_steps(steps[-1:], channel="train")
            acked = time.perf_counter()
            while True:
                group = consumer.fetch_group(timeout=30)
                if group is None:
                    raise RuntimeError(f"group {uid} never arrived")
                if group.prompt_uid == uid:
                    break
            result.append(time.perf_counter() - acked)
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(n_groups: int = 400, n_latency: int = 100) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-bench-"))
    broker = None
    bootstrap = os.environ.get("TRAJBUS_BOOTSTRAP_SERVERS")
    if not bootstrap:
        broker = EmbeddedKafka(state_dir=workdir / "broker")
        bootstrap = broker.start().bootstrap_servers
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    worker = None
    try:
        _, steps = make_groups(n_groups, 4, 3, seed=1, window=50)
        values = [(s.prompt_uid.encode(), codec.encode(s)) for s in steps]
        raw_s = raw_round_trip(bootstrap, values, partitions=8)

        with StepProducer(bootstrap, prefix=prefix) as producer:
            producer.provision("train")
        worker = worker_process(bootstrap, prefix, workdir / "worker.log", n_rollouts=4).start()
        assembled_round_trip(bootstrap, prefix, make_groups(8, 4, 3, seed=9, tag="warm")[1], 8)  # warm-up
        assembled_s = assembled_round_trip(bootstrap, prefix, steps, n_groups)
        lat = latencies(bootstrap, prefix, n_latency)
    finally:
        if worker is not None:
            worker.stop()
        if broker is not None:
            broker.stop()

    result = {
        "steps": len(steps), "groups": n_groups,
        "raw_steps_per_s": len(steps) / raw_s, "assembled_steps_per_s": len(steps) / assembled_s,
        "throughput_ratio": raw_s / assembled_s,
        "latency_p50_ms": 1000 * statistics.median(lat), "latency_p99_ms": 1000 * percentile(lat, 0.99),
        "latency_samples": len(lat),
    }
    print(f"\nassembly: {len(steps)} steps = {n_groups} groups x 4 trajectories x 3 steps, 8 partitions")
    print_table(["path", "steps/s", "ratio"],
                [["raw produce + consume (baseline)", f"{result['raw_steps_per_s']:.0f}", "1.00x"],
                 ["submit -> worker -> fetch_group", f"{result['assembled_steps_per_s']:.0f}",
                  f"{result['throughput_ratio']:.2f}x"]])
    print()
    print_table(["latency", "ms"],
                [["p50", f"{result['latency_p50_ms']:.1f}"], ["p99", f"{result['latency_p99_ms']:.1f}"]],
                title=f"last step acknowledged -> group fetchable ({len(lat)} groups, one at a time)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "assembly.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
