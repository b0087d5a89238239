"""What the CLI shows a person: a worker or gateway that stopped is not live at once, the stats table fits 120 columns,
and a reader that closes the pipe early (``| head -1``) ends a command without a traceback."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time

from confluent_kafka import Producer

from trajbus.infra.terminal import SIGPIPE_EXIT
from trajbus.infra.topics import TopicSpec, ensure_topics
from trajbus.streams.wire.topics import stats_topic
from trajbus.streams.wire.stats import is_live
from trajbus.streams.client.snapshots import read_snapshots
from tests.helpers import trajbus, wait_for


def test_a_worker_stopped_by_sigterm_is_not_live_at_once(bootstrap_servers: str, prefix: str, start_worker):
    worker = start_worker()
    wait_for(lambda: any(is_live(s, time.time()) for s in read_snapshots(bootstrap_servers, prefix)), 120,
             "the worker's first statistics", interval=0.5)
    common = ["--bootstrap-servers", bootstrap_servers, "--prefix", prefix]
    running = trajbus("stats", *common)
    assert running.returncode == 0 and running.stdout.startswith("workers: 1 live, 1 seen\n"), running.stdout

    assert worker.stop() == 0, f"the worker did not stop cleanly:\n{worker.log_tail()}"  # SIGTERM, then its exit
    stopped = trajbus("stats", *common)  # at once: its last snapshot is 30 s from ageing out
    assert stopped.returncode == 0 and stopped.stdout.startswith("workers: 0 live, 1 seen\n"), stopped.stdout
    assert stopped.stdout.splitlines()[3].split()[-1] == "0", "no partition held by a live worker"
    report = json.loads(trajbus("stats", *common, "--json").stdout)
    assert (report["workers"], report["live"], report["partitions"]) == (1, 0, {})


def test_the_stats_table_fits_120_columns_and_wide_shows_every_column(bootstrap_servers: str, prefix: str,
                                                                       start_worker):
    start_worker()
    common = ["--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--wait", "60"]
    default = trajbus("stats", *common, env={"COLUMNS": "1000"})  # not a terminal: the table's own width
    assert default.returncode == 0, default.stderr
    lines = default.stdout.splitlines()
    assert max(map(len, lines)) <= 120, default.stdout
    assert re.split(r"\s{2,}", lines[1].strip()) == ["channel", "steps in", "traj done", "ready", "partial", "emitted",
                                                   "pending", "queue", "policy", "gw in flight", "partitions"]
    wide = trajbus("stats", *common, "--wide")
    assert wide.returncode == 0, wide.stderr
    assert re.split(r"\s{2,}", wide.stdout.splitlines()[1].strip()) == [
        "channel", "steps in", "traj done", "ready", "partial", "emitted", "pending", "pend traj", "queue", "dups",
        "late", "policy", "gw in flight", "partitions"]


def test_a_reader_that_closes_the_pipe_early_ends_a_command_quietly(bootstrap_servers: str, prefix: str):
    topic = f"{prefix}.many"
    ensure_topics(bootstrap_servers, [TopicSpec(topic, 1)])
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    for i in range(3000):  # 400 kB of lines: far past what a pipe holds once `head` is gone
        producer.produce(topic, value=json.dumps({"n": i, "pad": "x" * 100}).encode())
    assert producer.flush(30) == 0
    tail = shlex.join([sys.executable, "-m", "trajbus.pipelines.cli", "tail", topic, "--from-beginning",
                       "--max", "3000", "--bootstrap-servers", bootstrap_servers])
    result = subprocess.run(["bash", "-c", f'{tail} | head -1; echo "trajbus exited ${{PIPESTATUS[0]}}" >&2'],
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith(f"{topic}[0]@0 ") and result.stdout.count("\n") == 1, result.stdout
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert result.stderr.endswith(f"trajbus exited {SIGPIPE_EXIT}\n"), result.stderr


def test_a_gateway_that_stopped_is_neither_live_nor_seen(bootstrap_servers: str, prefix: str):
    """A gateway's last word on the stats topic is a tombstone (gateway/admission/backlog.py): its snapshot is gone."""
    topic = stats_topic(prefix)
    ensure_topics(bootstrap_servers, [TopicSpec(topic, 1)])
    snapshot = {"worker_id": "gateway-a", "updated_at": time.time(),
                "samples": [["trajbus_gateway_in_flight_groups", {"channel": "train"}, 2]]}
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    producer.produce(topic, key=b"gateway-a", value=json.dumps(snapshot).encode())
    assert producer.flush(30) == 0
    common = ["--bootstrap-servers", bootstrap_servers, "--prefix", prefix]
    serving = trajbus("stats", *common)
    assert serving.stdout.startswith("workers: 1 live, 1 seen\n"), serving.stdout
    producer.produce(topic, key=b"gateway-a", value=None)
    assert producer.flush(30) == 0
    gone = trajbus("stats", *common)
    assert gone.stdout == f"no worker statistics under prefix {prefix!r} yet (is `trajbus worker` running?)\n"
