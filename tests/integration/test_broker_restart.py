"""A routine broker restart needs no person: worker, gateway and trainer ride through it.

The broker (of this test's own) is SIGKILLed under load and started again on the
same port about 20 s later. Every step the broker acknowledged reaches the trainer
exactly once; the worker, the gateway and the trainer's consumer are the same
processes and objects before and after. The worker's log reads as trajbus's lines
(issue 36): the outage began and ended, its periodic work waited, no library's
attempts and no traceback, and after the limit one line.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx

from trajbus.consumers import BatchConsumer
from trajbus.pipelines.processes import ServiceProcess, free_port, gateway_process, wait_http, worker_process
from trajbus.streams.client.producer import StepProducer
from tests.helpers import flowing, submit_until_stopped, wait_for

OUTAGE_SECONDS = 20
OUR_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ trajbus\.")
"""A line trajbus logged (``infra.logs.FORMAT``, a logger under ``trajbus``)."""


def not_ours(log: str) -> list[str]:
    """The lines of a worker's log (default verbosity) that trajbus did not write: a library's line, a
    traceback, anything printed bare; the CLI's last line on exit is trajbus's."""
    return [line for line in log.splitlines() if not OUR_LINE.match(line) and not line.startswith("trajbus worker: ")]


def worker_and_gateway(servers: str, prefix: str, engine: str, tiny_model_dir: Path, port: int, logs: Path,
                       extra: list[str]) -> tuple[ServiceProcess, ServiceProcess]:
    """A worker and a gateway (not yet started) on the test's broker, both with ``extra`` flags."""
    return (worker_process(servers, prefix, logs / "worker.log", n_rollouts=2, extra=extra),
            gateway_process(servers, prefix, [engine], tiny_model_dir, port, logs / "state", logs / "gateway.log",
                            extra))


def ride_through(broker, trainer: BatchConsumer, port: int, acked: dict[str, int],
                 stop: threading.Event) -> list[str]:
    """Under load: SIGKILL the broker, start it again, stop the load, one gateway call; returns the
    prompt uids the trainer received until every acknowledged group was among them."""
    received: list[str] = []

    def receive(done) -> bool:
        group = trainer.fetch_group(1.0)
        if group is not None:
            received.append(group.prompt_uid)
        return done()

    wait_for(lambda: receive(lambda: len(received) >= 5), 120, "groups before the outage")
    os.kill(broker.read_state().pid, signal.SIGKILL)
    time.sleep(OUTAGE_SECONDS)  # the outage itself, not a wait for a condition
    before_restart = len(acked)
    broker.start()
    wait_for(lambda: len(acked) >= before_restart + 10, 120, "acknowledged load after the restart")
    stop.set()

    t = httpx.post(f"http://127.0.0.1:{port}/init_trajectory", json={"prompt_uid": "after", "n_rollouts": 1},
                   timeout=30).json()
    reply = httpx.post(f"{t['base_url']}/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}]})
    assert reply.status_code == 200, reply.text
    assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1.0}).status_code == 200
    acked["after"] = 1
    try:
        wait_for(lambda: receive(lambda: set(acked) <= set(received)), 180, "every acknowledged group")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: acknowledged, never received: {sorted(set(acked) - set(received))}; "
                             f"received {len(received)} of {len(acked)} acknowledged") from None
    return received


def test_worker_gateway_and_trainer_ride_through_a_broker_restart(own_broker, prefix, scripted_engine,
                                                                tiny_model_dir, tmp_path: Path):
    servers = own_broker.read_state().bootstrap_servers
    engine, _ = scripted_engine(["Four."])
    port = free_port()
    worker, gateway = worker_and_gateway(servers, prefix, engine, tiny_model_dir, port, tmp_path, [])
    acked: dict[str, int] = {}
    stop = threading.Event()
    try:
        with StepProducer(servers, prefix=prefix, timeout=5) as producer, \
                BatchConsumer("train", servers, prefix=prefix) as trainer:
            producer.provision("train")
            worker.start()
            gateway.start()
            wait_http(f"http://127.0.0.1:{port}/ready", 120, gateway)
            load = threading.Thread(target=submit_until_stopped, args=(producer, acked, stop))
            load.start()
            try:
                received = ride_through(own_broker, trainer, port, acked, stop)
            finally:
                stop.set()
                load.join(60)  # before the producer closes under it
        assert len(received) == len(set(received)), "a group arrived twice"
        assert worker.alive() and gateway.alive(), "a component did not ride through the restart"
        log = worker.log_file.read_text()
        assert not not_ours(log), "lines not trajbus's in the worker's log:\n" + "\n".join(not_ours(log)[:20])
        assert "rides through a Kafka outage for up to 120s" in log, "the ready line says the outage limit"
        assert log.count("Kafka outage began") == 1 and log.count("Kafka outage ended") == 1, log
        assert len(re.findall(r"WARNING trajbus\.worker periodic work .* waits for Kafka", log)) <= 1, log
    finally:
        gateway.stop()
        worker.stop()


def test_past_the_outage_limit_worker_and_gateway_exit_with_one_line(own_broker, prefix, scripted_engine,
                                                                    tiny_model_dir, tmp_path: Path):
    servers = own_broker.read_state().bootstrap_servers
    engine, _ = scripted_engine(["Four."])
    port = free_port()
    worker, gateway = worker_and_gateway(servers, prefix, engine, tiny_model_dir, port, tmp_path,
                                         ["--broker-outage-limit", "8"])
    try:
        with StepProducer(servers, prefix=prefix) as producer:
            producer.provision("train")
        worker.start()
        gateway.start()
        wait_http(f"http://127.0.0.1:{port}/ready", 120, gateway)
        own_broker.stop()  # for good
        wait_for(lambda: not worker.alive() and not gateway.alive(), 120, "both to give up")
        for process, name in ((worker, "worker"), (gateway, "gateway")):
            assert process.process.returncode != 0
            last = process.log_tail(1)
            assert last.startswith(f"trajbus {name}: Kafka unreachable for") and "--broker-outage-limit 8" in last
        log = worker.log_file.read_text()
        assert not not_ours(log), "lines not trajbus's in the worker's log:\n" + "\n".join(not_ours(log)[:20])
    finally:
        gateway.stop()
        worker.stop()


def test_the_worker_survives_five_broker_kills_in_a_row(own_broker, prefix, tmp_path: Path):
    servers = own_broker.read_state().bootstrap_servers
    worker = worker_process(servers, prefix, tmp_path / "worker.log", n_rollouts=2)
    try:
        with flowing(servers, prefix, worker, call_timeout=5) as flow:
            for kill in range(5):
                flow.receive_until(lambda: len(flow.received) >= 2 * (kill + 1), 120, f"groups before kill {kill}")
                os.kill(own_broker.read_state().pid, signal.SIGKILL)
                wait_for(lambda: own_broker.status() is None, 30, "the broker to die")
                own_broker.start()
                flow.more_acked(3)
                assert worker.alive(), f"the worker died at kill {kill}:\n{worker.log_tail()}"
            flow.finish()
        assert worker.alive(), f"the worker died:\n{worker.log_tail()}"
    finally:
        worker.stop()
