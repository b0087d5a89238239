"""The broker a benchmark measures against: the user's (``--bootstrap-servers``'s environment,
``TRAJBUS_BOOTSTRAP_SERVERS``, or ``trajbus broker up``'s), else an embedded one started for the run."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from trajbus.infra.bootstrap import BrokerNotFound, resolve_bootstrap_servers
from trajbus.infra.kafka_broker import EmbeddedKafka


@contextlib.contextmanager
def bench_broker(workdir: Path) -> Iterator[str]:
    """Bootstrap servers for the run; an embedded broker (its state under ``workdir``) is stopped at the end."""
    try:
        servers = resolve_bootstrap_servers()
    except BrokerNotFound:
        servers = None
    if servers is not None:
        yield servers
        return
    broker = EmbeddedKafka(state_dir=workdir / "broker")
    try:
        yield broker.start().bootstrap_servers
    finally:
        broker.stop()
