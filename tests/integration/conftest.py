"""Fixtures: one real Kafka broker per test session, a topic prefix per test, worker processes."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from trajbus.infra import ray_exit
from trajbus.infra.bootstrap import ENV_VAR
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.pipelines.processes import (ServiceProcess, free_port, gateway_process, inference_server_process,
                                         scripted_engine_process, wait_http, worker_process)


@pytest.fixture(scope="session")
def bootstrap_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An external cluster when TRAJBUS_BOOTSTRAP_SERVERS is set, else a fresh embedded broker."""
    external = os.environ.get(ENV_VAR)
    if external:
        yield external
        return
    broker = EmbeddedKafka(state_dir=tmp_path_factory.mktemp("kafka"))
    state = broker.start(fresh=True)
    try:
        yield state.bootstrap_servers
    finally:
        broker.stop()


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[EmbeddedKafka]:
    """A broker of this test's own (started), to pause, kill or restart; resumed if paused and stopped at the end."""
    broker = EmbeddedKafka(state_dir=tmp_path / "kafka")
    broker.start(fresh=True)
    try:
        yield broker
    finally:
        state = broker.read_state()
        if state is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.pid, signal.SIGCONT)
        broker.stop()


@pytest.fixture
def prefix() -> str:
    """Topics of each test live under their own prefix, so tests never see each other's data."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def start_worker(bootstrap_servers: str, prefix: str, tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    workers: list[ServiceProcess] = []

    def start(**options) -> ServiceProcess:
        worker = worker_process(bootstrap_servers, prefix, tmp_path / f"worker{len(workers)}.log", **options)
        workers.append(worker.start())
        return worker

    yield start
    for worker in workers:
        worker.stop()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny chat model and tokenizer, built from the project's files (cached between runs)."""
    from trajbus.infra import tiny_model

    return tiny_model.build()


@pytest.fixture(scope="session")
def start_inference_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                           ) -> Iterator[Callable[[], tuple[str, ServiceProcess]]]:
    """Starts local inference servers (``HOST:PORT``, process); all stopped at the end of the session."""
    servers: list[ServiceProcess] = []
    logs = tmp_path_factory.mktemp("inference")

    def start() -> tuple[str, ServiceProcess]:
        port = free_port()
        server = inference_server_process(port, logs / f"server{len(servers)}.log", tiny_model_dir).start()
        servers.append(server)
        wait_http(f"http://127.0.0.1:{port}/health", 120, server)
        return f"127.0.0.1:{port}", server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def inference_server(start_inference_server: Callable[[], tuple[str, ServiceProcess]]) -> str:
    """One inference server shared by the session's gateway tests."""
    return start_inference_server()[0]


@pytest.fixture
def start_gateway(bootstrap_servers: str, prefix: str, tiny_model_dir: Path, tmp_path: Path
                  ) -> Iterator[Callable[..., tuple[str, ServiceProcess]]]:
    """Starts gateways (base URL, process) on this test's prefix; ``wait=False`` skips waiting for /ready."""
    gateways: list[ServiceProcess] = []

    def start(backends: list[str], extra: list[str] | None = None, port: int | None = None,
              state_dir: Path | None = None, wait: bool = True) -> tuple[str, ServiceProcess]:
        port = port or free_port()
        gateway = gateway_process(bootstrap_servers, prefix, backends, tiny_model_dir, port,
                                  state_dir or tmp_path / "gateway-state", tmp_path / f"gateway{len(gateways)}.log",
                                  ["--prompt-length", "512", "--response-length", "64", "--health-interval", "0.5",
                                   *(extra or [])]).start()
        gateways.append(gateway)
        url = f"http://127.0.0.1:{port}"
        if wait:
            wait_http(f"{url}/ready", 120, gateway)
        return url, gateway

    yield start
    for gateway in gateways:
        gateway.stop()


@pytest.fixture
def scripted_engine(tiny_model_dir: Path, tmp_path: Path):
    """Starts the scripted engine on the tiny tokenizer: (HOST:PORT, file of the prompts it received)."""
    engines: list[ServiceProcess] = []

    def start(replies: list[str | dict], workers: int = 1) -> tuple[str, Path]:
        port, record = free_port(), tmp_path / f"engine{len(engines)}-prompts.jsonl"
        engine = scripted_engine_process(port, tmp_path, tiny_model_dir, replies, record, workers).start()
        engines.append(engine)
        wait_http(f"http://127.0.0.1:{port}/health", 60, engine)
        return f"127.0.0.1:{port}", record

    yield start
    for engine in engines:
        engine.stop()


@pytest.fixture
def local_ray(prefix: str) -> Iterator[Any]:
    """A local Ray cluster for one test, this process its driver (namespace: the test's prefix;
    ``tests`` importable by its workers); shut down after the test."""
    ray_exit.connect(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=prefix,
                     runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}})
    import ray

    yield ray
    ray.shutdown()


EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After the report: a session that drove Ray ends through ``infra.ray_exit`` (Ray's gRPC
    threads outlive ``ray.shutdown()`` and can crash the interpreter's exit)."""
    ray_exit.exit_process(config.stash.get(EXIT_STATUS, 0))
