"""``trajbus tail``: a topic's records, live, one line each (or one JSON object each).

Any trajbus topic can be followed: steps, trajectory ends and groups are
decoded with the codec; policy and statistics records are JSON; a dead letter
shows its reason header. Reads with ``assign()`` and never commits, so tailing
disturbs no consumer group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import uuid
from typing import Any, TextIO

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Message, TopicPartition

from trajbus.infra.clients import reader
from trajbus.streams.wire import codec
from trajbus.streams.wire.dlq import REASON
from trajbus.streams.wire.prefix import StepDelta
from trajbus.streams.wire.records import ChunkedGroup, ReadyGroup, Step, TrajectoryEnd

log = logging.getLogger(__name__)


class UnknownTopic(ValueError):
    pass


def describe(message: Message) -> dict[str, Any]:
    """The record as a JSON-ready dict: where it is, and what it holds."""
    headers = {k: v.decode(errors="replace") for k, v in (message.headers() or [])}
    where = {"topic": message.topic(), "partition": message.partition(), "offset": message.offset(),
             "timestamp_ms": message.timestamp()[1],
             "key": message.key().decode(errors="replace") if message.key() is not None else None}
    value = message.value() or b""
    if REASON in headers:
        return {**where, "kind": "dead_letter", "reason": headers[REASON], "bytes": len(value)}
    if value[:2] == b"TB":
        try:
            record = codec.decode(value)
        except ValueError as exc:
            return {**where, "kind": "undecodable", "error": str(exc), "bytes": len(value)}
        if isinstance(record, StepDelta):  # its prompt_ids: the tokens after a prefix of step base_index
            return {**where, "kind": "step", "record": {
                **dataclasses.asdict(record.step),
                "prompt_extends": {"step_index": record.base_index, "prefix_len": record.prefix_len}}}
        kind = {Step: "step", TrajectoryEnd: "end", ReadyGroup: "group", ChunkedGroup: "chunked_group"}[type(record)]
        return {**where, "kind": kind, "record": dataclasses.asdict(record)}
    try:
        return {**where, "kind": "json", "record": json.loads(value)}
    except ValueError:
        return {**where, "kind": "bytes", "bytes": len(value)}


def readable(entry: dict[str, Any]) -> str:
    head = f"{entry['topic']}[{entry['partition']}]@{entry['offset']} key={entry['key']}"
    record = entry.get("record")
    kind = entry["kind"]
    if kind == "step":
        extends = record.get("prompt_extends")
        new = len(record["prompt_ids"])
        prompt = f"{new}" if extends is None else f"{extends['prefix_len'] + new} (#{extends['step_index']}+{new})"
        return (f"{head} step {record['trajectory_uid']}#{record['step_index']} v{record['policy_version']} "
                f"prompt={prompt} response={len(record['response_ids'])} "
                f"reward={record['reward']:g}" + (" last" if record["is_last"] else "")
                + (f" versions={record['version_segments']}" if record.get("version_segments") else ""))
    if kind == "end":
        return f"{head} end {record['trajectory_uid']} reward={record['reward']}"
    if kind == "group":
        steps = record["steps"]
        rewards = [s["reward"] for s in steps if s["is_last"]]
        versions = sorted({s["policy_version"] for s in steps})
        trajectories = len({s["trajectory_uid"] for s in steps})
        return (f"{head} group {record['status']} trajectories={trajectories} steps={len(steps)} "
                f"versions={versions} rewards={rewards}")
    if kind == "chunked_group":
        return (f"{head} chunked group of {record['size']} bytes in {len(record['offsets'])} chunks at "
                f"{record['topic']}[{record['partition']}]")
    if kind == "dead_letter":
        return f"{head} dead letter ({entry['bytes']} bytes): {entry['reason']}"
    if kind == "json":
        return f"{head} {json.dumps(record, sort_keys=True)}"
    return f"{head} {kind} ({entry['bytes']} bytes){': ' + entry['error'] if 'error' in entry else ''}"


def tail(bootstrap_servers: str, topic: str, from_beginning: bool = False, max_records: int | None = None,
         as_json: bool = False, out: TextIO = sys.stdout) -> int:
    """Print records of ``topic`` as they arrive; returns how many were printed."""
    consumer = reader(bootstrap_servers, {
        "group.id": f"trajbus.tail.{uuid.uuid4().hex[:8]}", "fetch.wait.max.ms": 100, "logger": log})
    try:
        topics = consumer.list_topics(timeout=10).topics
        if topic not in topics:
            raise UnknownTopic(f"topic {topic!r} does not exist (see `trajbus topics`)")
        start = OFFSET_BEGINNING if from_beginning else OFFSET_END
        consumer.assign([TopicPartition(topic, p, start) for p in sorted(topics[topic].partitions)])
        positions = []
        for p in sorted(topics[topic].partitions):  # resolve the positions before saying we are live
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            positions.append(str(low if from_beginning else high))
        until = "Ctrl-C stops" if max_records is None else f"until {max_records} records, or Ctrl-C"
        print(f"tailing {topic} from offsets {','.join(positions)} ({until})", file=sys.stderr, flush=True)
        printed = 0
        while max_records is None or printed < max_records:
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            entry = describe(message)
            print(json.dumps(entry) if as_json else readable(entry), file=out, flush=True)
            printed += 1
        return printed
    except KeyboardInterrupt:
        return 0
    finally:
        consumer.close()
