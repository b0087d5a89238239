"""Smoke test of the pip-only broker: `trajbus broker up --engine tansu`, then the first path on it."""

from __future__ import annotations

from trajbus.consumers import BatchConsumer
from trajbus.pipelines.processes import worker_process
from trajbus.pipelines.synthetic import make_groups
from trajbus.streams.client.producer import StepProducer
from tests.helpers import assert_exactly_the_groups_sent, fetch_groups, settle_workers, trajbus


def test_first_path_on_the_tansu_engine(tmp_path, prefix):
    state = tmp_path / "tansu"
    up = trajbus("broker", "up", "--engine", "tansu", "--state-dir", str(state), timeout=60)
    assert up.returncode == 0, up.stderr
    servers = up.stdout.strip().splitlines()[-1]  # the last line is the address, by contract
    worker = None
    try:
        status = trajbus("broker", "status", "--state-dir", str(state))
        assert status.returncode == 0 and "tansu" in status.stdout and servers in status.stdout
        sent, stream = make_groups(20, 3, 2, seed=6)
        with StepProducer(servers, prefix=prefix) as producer:
            producer.provision("train")
            worker = worker_process(servers, prefix, tmp_path / "worker.log", n_rollouts=3).start()
            assert producer.submit_steps(stream, channel="train") == len(stream)
        with BatchConsumer("train", servers, prefix=prefix) as consumer:
            groups = fetch_groups(consumer, 20, timeout=120)
            settle_workers(servers, prefix, [worker])
            assert consumer.drain() == []
        assert_exactly_the_groups_sent(groups, sent)
    finally:
        if worker is not None:
            worker.stop()
        down = trajbus("broker", "down", "--state-dir", str(state))
    assert down.returncode == 0 and down.stdout.startswith("stopped the Tansu broker (pid "), down.stdout
    assert f") at {servers}, state in {state}" in down.stdout, down.stdout
