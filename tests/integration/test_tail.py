"""`trajbus tail`: a topic's records live, readable or as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from confluent_kafka import Producer

from trajbus.pipelines.synthetic import make_groups
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.topics import dlq_topic, groups_topic, steps_topic
from tests.helpers import through_worker, trajbus, wait_for


def test_tail_follows_steps_live_and_reads_groups_and_dead_letters(bootstrap_servers, prefix, start_worker):
    sent, stream = make_groups(2, 2, 2, seed=8)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
    live = subprocess.Popen([sys.executable, "-m", "trajbus.pipelines.cli", "tail", steps_topic("train", prefix),
                             "--bootstrap-servers", bootstrap_servers, "--max", str(len(stream))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert "tailing" in live.stderr.readline()  # positioned at the end: only what comes next is shown
        threading.Thread(target=lambda: lines.extend(live.stdout), daemon=True).start()
        through_worker(bootstrap_servers, prefix, start_worker, stream, n_rollouts=2)
        assert live.wait(60) == 0
    finally:
        live.kill()
    wait_for(lambda: len(lines) == len(stream), 10, "every step printed")
    first = stream[0]
    assert any(f"key={first.prompt_uid} step {first.trajectory_uid}#{first.step_index} v0 "
               f"prompt={len(first.prompt_ids)} response={len(first.response_ids)}" in line for line in lines)

    groups = wait_for(lambda: (r := trajbus("tail", groups_topic("train", prefix), "--bootstrap-servers",
                                            bootstrap_servers, "--from-beginning", "--max", "2", "--json",
                                            timeout=60)).returncode == 0 and r, 60, "the groups")
    entries = [json.loads(line) for line in groups.stdout.splitlines()]
    assert {e["key"] for e in entries} == set(sent) and all(e["kind"] == "group" for e in entries)
    assert all(len(e["record"]["steps"]) == 4 for e in entries)

    producer = Producer({"bootstrap.servers": bootstrap_servers})
    producer.produce(steps_topic("train", prefix), key=b"junk", value=b"not a record")
    assert producer.flush(10) == 0
    producer.close()
    dead = wait_for(lambda: (r := trajbus("tail", dlq_topic(prefix), "--bootstrap-servers", bootstrap_servers,
                                          "--from-beginning", "--max", "1", timeout=60)).returncode == 0 and r,
                    60, "the dead letter")
    assert "key=junk dead letter" in dead.stdout and "undecodable" in dead.stdout

    missing = trajbus("tail", f"{prefix}.nope", "--bootstrap-servers", bootstrap_servers)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
