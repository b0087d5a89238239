"""Fixtures: one real Kafka broker per test session, a topic prefix per test, worker processes."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from infra.bootstrap import ENV_VAR
from infra.kafka_broker import EmbeddedKafka
from pipelines.processes import ServiceProcess, worker_process


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
