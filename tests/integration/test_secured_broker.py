"""trajbus on a broker that requires TLS and SASL credentials, as managed Kafka clusters do.

The embedded broker is started with ``secure=True`` (a SASL/PLAIN over TLS listener only,
its certificate signed by a CA of its own); every component takes the credentials and the
CA from the environment (``TRAJBUS_KAFKA_CONFIG``), and wrong credentials or an untrusted
certificate are named, not a hang.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from trajbus.consumers import BatchConsumer
from trajbus.infra.kafka_broker import BrokerState, EmbeddedKafka
from trajbus.infra.kafka_config import CONFIG_FILE_VAR, configure
from trajbus.pipelines.processes import free_port, gateway_process, worker_process
from trajbus.pipelines.synthetic import group_steps
from trajbus.streams.client.producer import StepProducer
from tests.helpers import fetch_groups, trajbus, wait_for


@pytest.fixture(scope="module")
def secured_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerState]:
    broker = EmbeddedKafka(state_dir=tmp_path_factory.mktemp("secured-kafka"), secure=True)
    state = broker.start(fresh=True)
    try:
        yield state
    finally:
        broker.stop()


@pytest.fixture
def credentials(secured_broker: BrokerState, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The broker's client properties, in the environment of this process and of the services it starts."""
    monkeypatch.setenv(CONFIG_FILE_VAR, secured_broker.client_properties)
    configure(None)
    yield secured_broker.client_properties
    monkeypatch.delenv(CONFIG_FILE_VAR)
    configure(None)


def test_every_component_runs_on_a_sasl_broker(secured_broker, credentials, prefix, scripted_engine,
                                              tiny_model_dir, tmp_path: Path):
    servers = secured_broker.bootstrap_servers
    steps = [s for trajectory in group_steps("sasl-group", 2, 2, random.Random(3)) for s in trajectory]
    worker = worker_process(servers, prefix, tmp_path / "worker.log", n_rollouts=2)
    engine, _ = scripted_engine(["Four."])
    port = free_port()
    gateway = gateway_process(servers, prefix, [engine], tiny_model_dir, port, tmp_path / "state",
                              tmp_path / "gateway.log", ["--prompt-length", "512", "--response-length", "64"])
    try:
        with StepProducer(servers, prefix=prefix) as producer:  # the first path
            producer.provision("train")
            worker.start()
            producer.submit_steps(steps, channel="train")
        gateway.start()
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: gateway_ready(url), 120, "the gateway to connect with credentials")
        t = httpx.post(f"{url}/init_trajectory", json={"prompt_uid": "sasl-chat", "n_rollouts": 1}).json()
        reply = httpx.post(f"{t['base_url']}/chat/completions", timeout=60,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}]})
        assert reply.status_code == 200, reply.text
        assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1.0}).status_code == 200
        with BatchConsumer("train", servers, prefix=prefix, group_id=f"{prefix}.trainer") as consumer:
            groups = fetch_groups(consumer, 2, timeout=120)
        assert sorted(g.prompt_uid for g in groups) == ["sasl-chat", "sasl-group"]
    finally:
        gateway.stop()
        worker.stop()
    password = next(line.split("=", 1)[1] for line in Path(credentials).read_text().splitlines()
                    if line.startswith("sasl.password="))
    for log in ("worker.log", "gateway.log"):  # the connection is logged, its secret never
        text = (tmp_path / log).read_text()
        assert "'sasl.password': '***'" in text and password not in text, log
    listed = trajbus("replay", "--channel", "train", "--bootstrap-servers", servers, "--prefix", prefix,
                     "--from-offset", "0", "--to-offset", "2")
    assert listed.returncode == 0, listed.stderr
    assert "sasl-group" in listed.stdout and "sasl-chat" in listed.stdout


def gateway_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_the_broker_serves_clients_over_tls_only(secured_broker, credentials, tmp_path: Path):
    properties = Path(credentials).read_text()
    assert "security.protocol=SASL_SSL" in properties and "ssl.ca.location=" in properties
    untrusting = tmp_path / "no-ca.properties"  # the system's CAs never signed the broker's certificate
    untrusting.write_text("".join(line + "\n" for line in properties.splitlines()
                                  if not line.startswith("ssl.ca.location=")))
    result = trajbus("topics", "--bootstrap-servers", secured_broker.bootstrap_servers,
                     env={CONFIG_FILE_VAR: str(untrusting)}, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Kafka TLS handshake failed" in result.stderr and "check ssl.ca.location" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    plaintext = trajbus("topics", "--bootstrap-servers", secured_broker.bootstrap_servers,
                        env={CONFIG_FILE_VAR: ""}, timeout=120)
    assert plaintext.returncode != 0, "a plaintext client must not get in"


def test_wrong_credentials_are_named(secured_broker, credentials, prefix, scripted_engine, tiny_model_dir,
                                     tmp_path: Path):
    wrong = tmp_path / "wrong.properties"
    wrong.write_text(Path(credentials).read_text().replace("sasl.password=", "sasl.password=not-"))
    servers = secured_broker.bootstrap_servers
    result = trajbus("topics", "--bootstrap-servers", servers, env={CONFIG_FILE_VAR: str(wrong)}, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Kafka authentication failed" in result.stderr and "not-" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    engine, _ = scripted_engine(["Four."])
    port = free_port()
    gateway = gateway_process(servers, prefix, [engine], tiny_model_dir, port, tmp_path / "state",
                              tmp_path / "gateway.log", ["--kafka-config", str(wrong)]).start()
    try:
        def refused() -> str | None:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
            except httpx.TransportError:
                return None
            reason = response.json().get("reason", "")
            return reason if response.status_code == 503 and "authentication failed" in reason else None

        reason = wait_for(refused, 120, "the gateway to report the refused credentials")
        assert "not-" not in reason
    finally:
        gateway.stop()
