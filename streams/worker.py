"""Running the stream processor as a process (``trajbus worker``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import faust

from infra.bootstrap import resolve_bootstrap_servers
from infra.logs import FORMAT
from infra.topics import ensure_topics
from streams.app import build_app
from streams.settings import WorkerSettings


def _logging_config(faust_level: str) -> dict:
    """trajbus's structured lines at INFO; Faust and its clients at ``faust_level``."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"line": {"format": FORMAT}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "line"}},
        "root": {"level": "INFO", "handlers": ["stderr"]},
        "loggers": {name: {"level": faust_level} for name in ("faust", "mode", "aiokafka", "kafka")},
    }


def run_worker(settings: WorkerSettings, bootstrap_servers: str | None = None, loglevel: str = "WARNING") -> None:
    """Provision the topics, then process until SIGINT/SIGTERM (graceful shutdown)."""
    servers = resolve_bootstrap_servers(bootstrap_servers)
    ensure_topics(servers, settings.topics.specs(settings.channels))
    with tempfile.TemporaryDirectory(prefix=f"trajbus-{settings.app_id}-") as datadir:
        app, assembler = build_app(servers, settings, Path(datadir))
        # Faust applies its loglevel to the handler, so the handler takes INFO and the
        # logger configuration decides what each library may say.
        worker = faust.Worker(app, loglevel="INFO", quiet=True, redirect_stdouts=False,
                              logging_config=_logging_config(loglevel))
        assembler.start()
        try:
            worker.execute_from_commandline()
        finally:
            assembler.stop()
