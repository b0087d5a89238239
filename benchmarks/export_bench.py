"""``trajbus export`` against a plain Kafka read of the same groups topic, in the same run.

Groups of real size: 8 rollouts x 16 turns, each trajectory's context growing to 32k tokens
(a 151k vocabulary: 4 bytes a token on the wire), with log-probs, written to a groups topic as
the worker writes them (``streams.client.chunks.produce_group``: the wire's prefix structure, a
chunked group past ``max.message.bytes``). The baseline is a plain ``confluent_kafka`` consumer
reading every record of that topic to its end (bytes only, no decoding); the export decodes the
same records, builds the rows and writes zstd Parquet parts (``pipelines.export``). Each is run
``--repeat`` times alternately, the best time of each kept; the ratio is the result (target
>= 0.5x, in rows/s and in wire MB/s, which share a denominator). A third row is the floor under any
Parquet export of these rows: the same rows encoded with the export's settings, alone (no Kafka, no
decoding). Prints the tables and writes benchmarks/results/export.json.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import TopicPartition

from benchmarks.bench_broker import bench_broker
from benchmarks.targets import Target, print_targets
from trajbus.consumers.group_records import decode_group
from trajbus.infra.clients import acked_producer, admin, reader
from trajbus.infra.topics import ensure_topics, read_partition, watermarks
from trajbus.pipelines.export import Exporter, ExportSettings
from trajbus.pipelines.export_parts import encode_part
from trajbus.pipelines.export_rows import Provenance, RlColumns, trajectories
from trajbus.pipelines.tables import print_table
from trajbus.streams.client.chunks import ChunkReader, produce_group
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.records import ReadyGroup, Step
from trajbus.streams.wire.topics import chunks_topic, groups_topic

RESULTS = Path(__file__).resolve().parent / "results"
ROLLOUTS, TURNS, CONTEXT, VOCAB = 8, 16, 32_768, 151_000
FIRST_PROMPT = 1024
TARGET = 0.5


def make_group(prompt_uid: str, rng: np.random.Generator) -> ReadyGroup:
    """8 rollouts of one prompt, 16 turns each: every turn a response and a tool result, to ~32k tokens."""
    per_turn = (CONTEXT - FIRST_PROMPT) // TURNS
    prompt = rng.integers(0, VOCAB, FIRST_PROMPT).tolist()
    steps = []
    for rollout in range(ROLLOUTS):
        context = list(prompt)
        for turn in range(TURNS):
            between = rng.integers(0, VOCAB, per_turn // 2).tolist() if turn else []
            step_prompt = context + between
            response = rng.integers(0, VOCAB, per_turn - len(between) if turn else per_turn).tolist()
            steps.append(Step(prompt_ids=step_prompt, response_ids=response, trajectory_uid=f"{prompt_uid}/r{rollout}",
                              prompt_uid=prompt_uid, step_index=turn, reward=float(rollout % 2) if turn == TURNS - 1
                              else 0.0, policy_version=3, is_last=turn == TURNS - 1,
                              rollout_log_probs=(-rng.random(len(response), np.float32)).tolist()))
            context = step_prompt + response
    return ReadyGroup(prompt_uid=prompt_uid, channel="bench", steps=steps, n_rollouts=ROLLOUTS)


def write_groups(servers: str, prefix: str, count: int) -> int:
    """``count`` groups on ``{prefix}.groups.bench``, as the worker writes them; returns their wire bytes."""
    settings = TopicSettings(prefix=prefix)
    ensure_topics(servers, settings.channel_specs("bench"))
    producer = acked_producer(servers, {"compression.type": "lz4", "linger.ms": 5,
                                        "message.max.bytes": settings.max_message_bytes})
    rng, errors = np.random.default_rng(0), []
    for i in range(count):
        produce_group(producer, groups_topic("bench", prefix), chunks_topic("bench", prefix),
                      make_group(f"g{i}", rng), [], settings.max_message_bytes,
                      lambda error, _m: errors.append(error) if error else None)
        producer.poll(0)
    assert producer.flush(120) == 0 and not errors, errors
    return count


def plain_read(servers: str, topic: str) -> tuple[float, int, int]:
    """The baseline: every record of ``topic`` read to its end; (seconds, records, value bytes)."""
    consumer = reader(servers, {"enable.partition.eof": True, "fetch.wait.max.ms": 50})
    started = time.perf_counter()
    records = size = 0
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    for partition in partitions:
        low, high = watermarks(consumer, TopicPartition(topic, partition), 10.0)
        for message in read_partition(consumer, topic, partition, low, high):
            records, size = records + 1, size + len(message.value())
    elapsed = time.perf_counter() - started
    consumer.close()
    return elapsed, records, size


def export_once(servers: str, prefix: str, workdir: Path) -> tuple[float, int, int]:
    """The export of the whole topic into fresh parts; (seconds, rows, bytes on disk)."""
    output = workdir / f"export-{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    summary = Exporter(ExportSettings(channel="bench", output=output, bootstrap_servers=servers, prefix=prefix,
                                      part_rows=256)).run()
    elapsed = time.perf_counter() - started
    on_disk = sum(p.stat().st_size for p in output.glob("*.parquet"))
    shutil.rmtree(output)
    return elapsed, summary.rows_written, on_disk


def encoding_alone(servers: str, topic: str, repeat: int) -> float:
    """The floor under any Parquet export: the export's rows of the whole topic (decoded once, before the
    clock) encoded as one part with the export's settings, into memory; the best of ``repeat``."""
    consumer = reader(servers, {"enable.partition.eof": True})
    chunks, rows = ChunkReader(servers), RlColumns()
    try:
        for partition in consumer.list_topics(topic, timeout=10).topics[topic].partitions:
            low, high = watermarks(consumer, TopicPartition(topic, partition), 10.0)
            for message in read_partition(consumer, topic, partition, low, high):
                group = decode_group(chunks, message.value())
                for trajectory in trajectories(group):
                    rows.add(trajectory, group, Provenance(topic, partition, message.offset(), {}))
    finally:
        consumer.close()
        chunks.close()
    table, times = rows.table(), []
    for _ in range(repeat):
        started = time.perf_counter()
        encode_part(table, io.BytesIO())
        times.append(time.perf_counter() - started)
    return min(times)


def measure(servers: str, groups: int, repeat: int, workdir: Path) -> dict:
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    write_groups(servers, prefix, groups)
    print(f"wrote {groups} groups in {time.perf_counter() - started:.1f} s", flush=True)
    topic = groups_topic("bench", prefix)
    plain, export = [], []
    try:
        for _ in range(repeat):
            plain.append(plain_read(servers, topic))
            export.append(export_once(servers, prefix, workdir))
        encode_s = encoding_alone(servers, topic, repeat)
    finally:
        names = [name("bench", prefix) for name in (groups_topic, chunks_topic)]
        client = admin(servers)
        for future in client.delete_topics(names, operation_timeout=30).values():
            future.result()  # the run's megabytes go from the broker's disk
    plain_s, records, wire = min(plain)
    export_s, rows, on_disk = min(export)
    assert records == groups and rows == groups * ROLLOUTS, (records, rows)
    return {"groups": groups, "rows": rows, "wire_bytes": wire, "parquet_bytes": on_disk, "repeat": repeat,
            "plain_s": plain_s, "export_s": export_s, "encode_s": encode_s,
            "plain_rows_per_s": rows / plain_s, "export_rows_per_s": rows / export_s,
            "plain_mb_per_s": wire / plain_s / 1e6, "export_mb_per_s": wire / export_s / 1e6,
            "ratio": plain_s / export_s}


def report(result: dict) -> dict:
    print(f"\nexport: {result['groups']} groups of {ROLLOUTS} rollouts x {TURNS} turns to {CONTEXT} tokens "
          f"({result['wire_bytes'] / 1e6:.0f} MB on the wire, {result['parquet_bytes'] / 1e6:.0f} MB of Parquet), "
          f"best of {result['repeat']}")
    print_table(["reader", "seconds", "rows/s", "MB/s (wire)", "ratio"], [
        ["plain confluent_kafka consumer (baseline)", f"{result['plain_s']:.2f}", f"{result['plain_rows_per_s']:.0f}",
         f"{result['plain_mb_per_s']:.0f}", "1.00x"],
        ["trajbus export (RL shape, Parquet)", f"{result['export_s']:.2f}", f"{result['export_rows_per_s']:.0f}",
         f"{result['export_mb_per_s']:.0f}", f"{result['ratio']:.2f}x"],
        ["floor: the same rows' Parquet encoding alone", f"{result['encode_s']:.2f}",
         f"{result['rows'] / result['encode_s']:.0f}", f"{result['wire_bytes'] / result['encode_s'] / 1e6:.0f}",
         f"{result['plain_s'] / result['encode_s']:.2f}x"]])
    result["targets"] = print_targets([Target(
        "export throughput against a plain consumer", f">= {TARGET}x",
        f"{result['ratio']:.2f}x ({result['export_rows_per_s']:.0f} against {result['plain_rows_per_s']:.0f} rows/s; "
        f"{result['export_mb_per_s']:.0f} against {result['plain_mb_per_s']:.0f} MB/s)", result["ratio"] >= TARGET)],
        "export_bench")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.export_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64, help="groups written (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each reader (default: %(default)s)")
    args = parser.parse_args(argv)
    random.seed(0)
    with tempfile.TemporaryDirectory(prefix="trajbus-export-bench-") as workdir, bench_broker(Path(workdir)) as servers:
        result = report(measure(servers, args.groups, args.repeat, Path(workdir)))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "export.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
