"""The embedded broker through the CLI, and how components find a broker."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from confluent_kafka import Producer

from trajbus.infra import bootstrap
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.topics import TopicSpec, ensure_topics
from tests.helpers import end_offsets, trajbus


def test_broker_up_status_down_keeps_data_between_runs(tmp_path: Path):
    state_dir = str(tmp_path / "broker")
    up = trajbus("broker", "up", "--state-dir", state_dir)
    assert up.returncode == 0, up.stderr
    assert up.stderr == "", "the command's own lines only: no log line at default verbosity"
    address = up.stdout.strip().splitlines()[-1]
    host, port = address.split(":")
    assert host == "127.0.0.1" and int(port) > 0
    pid = re.search(r"running, pid (\d+),", up.stdout)[1]
    try:
        status = trajbus("broker", "status", "--state-dir", state_dir)
        assert status.returncode == 0 and status.stdout.strip().splitlines()[-1] == address
        # A second `up` finds the running broker instead of starting another.
        again = trajbus("broker", "up", "--state-dir", state_dir)
        assert again.stdout.strip().splitlines()[-1] == address

        ensure_topics(address, [TopicSpec("kept", 1)])
        producer = Producer({"bootstrap.servers": address})
        for i in range(5):
            producer.produce("kept", value=str(i).encode())
        assert producer.flush(30) == 0
        producer.close()
    finally:
        down = trajbus("broker", "down", "--state-dir", state_dir)
    assert down.returncode == 0, down.stderr
    assert down.stdout == f"stopped the Kafka broker (pid {pid}) at {address}, state in {state_dir}\n"
    stopped = trajbus("broker", "status", "--state-dir", state_dir)
    assert stopped.returncode == 1 and "not running" in stopped.stdout
    again = trajbus("broker", "down", "--state-dir", state_dir)
    assert (again.returncode, again.stdout) == (0, f"no broker running in {state_dir}\n")

    restarted = trajbus("-v", "broker", "up", "--state-dir", state_dir)
    assert restarted.returncode == 0, restarted.stderr
    assert "kafka broker ready at" in restarted.stderr, "-v: the broker's log lines too"
    try:
        new_address = restarted.stdout.strip().splitlines()[-1]
        assert new_address == address  # the same port again when it is free
        assert end_offsets(new_address, "kept") == [5]
    finally:
        trajbus("broker", "down", "--state-dir", state_dir)


def test_broker_down_names_each_node_of_a_cluster_it_stops(tmp_path: Path):
    """Two nodes (the cheapest cluster): one line per node, with the pid and address `up` printed."""
    state_dir = tmp_path / "cluster"
    up = trajbus("broker", "up", "--nodes", "2", "--state-dir", str(state_dir))
    try:
        assert up.returncode == 0, up.stderr
        started = re.findall(r"node at (\S+), pid (\d+),", up.stdout)
        assert len(started) == 2, up.stdout
    finally:
        down = trajbus("broker", "down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    assert down.stdout.splitlines() == [
        f"stopped node {n} of the Kafka cluster (pid {pid}) at {address}, state in {state_dir / f'node{n}'}"
        for n, (address, pid) in enumerate(started, start=1)]


def test_embedded_broker_is_found_without_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 bootstrap_servers: str):
    """With no flag and no variable, the state file of `trajbus broker up` names the broker."""
    monkeypatch.delenv(bootstrap.ENV_VAR, raising=False)
    monkeypatch.setenv("TRAJBUS_STATE_DIR", str(tmp_path))
    host, port = bootstrap_servers.split(":")
    state = EmbeddedKafka()
    state.state_file.write_text(json.dumps({
        "pid": os.getpid(), "host": host, "port": int(port), "controller_port": 0, "version": "x",
        "data_dir": "", "log_file": "",
    }))
    assert bootstrap.resolve_bootstrap_servers() == bootstrap_servers
    state.state_file.write_text(state.state_file.read_text().replace(str(os.getpid()), "999999999"))
    with pytest.raises(bootstrap.BrokerNotFound):
        bootstrap.resolve_bootstrap_servers()  # a dead pid is not a running broker
