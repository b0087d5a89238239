"""Running the stream processor as a process (``trajbus worker``)."""

from __future__ import annotations

import logging

import faust

from infra.bootstrap import resolve_bootstrap_servers
from infra.topics import ensure_topics
from streams.app import build_app
from streams.settings import WorkerSettings


def run_worker(settings: WorkerSettings, bootstrap_servers: str | None = None, loglevel: str = "WARNING") -> None:
    """Provision the topics, then process until SIGINT/SIGTERM (graceful shutdown)."""
    servers = resolve_bootstrap_servers(bootstrap_servers)
    ensure_topics(servers, settings.topics.specs(settings.channels))
    app, assembler = build_app(servers, settings)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    logging.getLogger("trajbus").setLevel(logging.INFO)
    assembler.start()
    try:
        worker.execute_from_commandline()
    finally:
        assembler.stop()
