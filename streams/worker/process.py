"""Running the stream processor as a process (``trajbus worker``), through broker outages.

A broker restart must not need a person to restart workers. When Kafka cannot be
reached (at start, or when Faust stops on a lost connection), the worker waits for
it and starts again in the same process (``exec``: same pid, state recovered from
the changelog as after any restart); only an outage longer than
``--broker-outage-limit`` ends it, non-zero, with one line, so a supervisor restarts it.

A worker whose ``--steps-partitions`` differs from its steps topics' count refuses to start
(``PartitionMismatch``, one line, exit 2) rather than adopt the topic's count: its table and
changelog are partitioned like its source, so a count it was not told about is a configuration
the user must settle (start it with the topic's count, or raise the topic on purpose).

The process owns the chores beside assembly (``streams.worker.chores``: the policy watcher, the
statistics on Kafka, the metrics endpoint): started once its topics exist, closed as it stops or
starts again.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable

import faust
from confluent_kafka import KafkaException

from trajbus.infra import tracing
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.kafka_config import connection_properties, error_words, redacted
from trajbus.infra.outage import KafkaUnreachable, OutageWatch
from trajbus.infra.retry import retrying
from trajbus.infra.topics import TopicSpec, ensure_topics, partition_counts
from trajbus.streams.worker.assembler import build_app, changelog_topic_name
from trajbus.streams.worker.chores import WorkerChores
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.wire.topics import steps_topic, traces_topic
from trajbus.streams.worker.logs import logging_config, lost_kafka
from trajbus.streams.worker.stats import WorkerMetrics

log = logging.getLogger("trajbus.worker")

OUTAGE_SINCE = "TRAJBUS_WORKER_OUTAGE_SINCE"
"""Set across the restart: when the worker lost Kafka, so the limit counts the whole outage."""


class PartitionMismatch(ValueError):
    """A steps topic's partition count is not the worker's ``--steps-partitions``: names both numbers."""


def _match_partitions(servers: str, settings: WorkerSettings, changelog_name: str) -> None:
    """Refuse a steps topic whose count differs from the worker's, before anything is provisioned. The
    table's changelog follows its steps topics: one behind them (they were raised on purpose) is raised."""
    wanted = settings.topics.steps_partitions
    changelog = settings.topics.table_spec(changelog_name, wanted)
    names = [steps_topic(channel, settings.topics.prefix) for channel in settings.channels]
    counts = partition_counts(servers, [*names, changelog.name], timeout=10.0)
    for name in names:
        count = counts.get(name, wanted)  # a missing topic is created with the worker's count
        if count != wanted:
            raise PartitionMismatch(
                f"topic {name} has {count} partitions but this worker was given --steps-partitions {wanted}: "
                f"start it with --steps-partitions {count}"
                + (f" (or raise the topic on purpose: trajbus topics --create --steps-partitions {wanted})"
                   if count < wanted else ""))
    if counts.get(changelog.name, wanted) < wanted:
        ensure_topics(servers, [changelog], timeout=10.0, grow_partitions=True)


def _provision(servers: str, specs: list[TopicSpec], outage_limit: float,
               check: Callable[[], None] | None = None) -> None:
    """Create the topics, waiting for Kafka while the outage (begun before a restart, or now) is in bounds;
    ``check`` runs first in each try. A replication the cluster cannot hold, or a ``check`` that refuses
    (a ``ValueError``), is a configuration error: it stops the worker at once."""
    carried = float(os.environ.pop(OUTAGE_SINCE, "0") or 0)
    since = carried or time.time()
    attempts = retrying(max(0.0, outage_limit - (time.time() - since)), log,  # the one retry policy
                        f"provisioning the worker's topics at {servers}", transient=(KafkaException, RuntimeError))
    try:
        for attempt in attempts:
            with attempt:
                if check is not None:
                    check()
                ensure_topics(servers, specs, timeout=10.0)
    except (KafkaException, RuntimeError) as exc:
        raise KafkaUnreachable(f"Kafka at {servers} unreachable for {time.time() - since:.0f}s "
                               f"(--broker-outage-limit {outage_limit:g}): {error_words(exc)}") from None
    if carried or attempts.statistics.get("attempt_number", 1) > 1:
        log.info("kafka reachable again after %.0fs outage; worker starting", time.time() - since)


def worker_topics(settings: WorkerSettings, changelog_name: str) -> list[TopicSpec]:
    """Every topic the worker reads or writes: the channels' and shared topics, and its table's changelog."""
    return settings.topics.specs(settings.channels) + [
        settings.topics.table_spec(changelog_name, settings.topics.steps_partitions)]


_gave_up: list[str] = []
GIVE_UP_GRACE = 5.0


def _give_up(reason: str) -> None:
    """Kafka stayed away past the limit: stop (gracefully if Faust can, within ``GIVE_UP_GRACE`` s), then
    exit non-zero. With no broker nothing is left to commit or flush; Faust's stop would wait out each
    client's timeouts (30 s and more) for nothing."""
    _gave_up.append(reason)
    log.error("%s", reason)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = threading.Timer(GIVE_UP_GRACE, lambda: (print(f"trajbus worker: {reason}", file=sys.stderr, flush=True),
                                              os._exit(1)))
    deadline.daemon = True
    deadline.start()


def run_worker(settings: WorkerSettings, bootstrap_servers: str | None = None) -> None:
    """Provision the topics, then process until SIGINT/SIGTERM (graceful shutdown); through outages of
    Kafka up to ``settings.broker_outage_limit`` seconds (``KafkaUnreachable`` past it)."""
    outage_limit = settings.broker_outage_limit
    servers = resolve_bootstrap_servers(bootstrap_servers)
    level = min(logging.INFO, logging.getLogger().getEffectiveLevel())  # DEBUG under `trajbus -v`
    connection = redacted(connection_properties())
    log.info("worker starting: Kafka at %s%s (waits up to %gs for it when unreachable: --broker-outage-limit)",
             servers, f" ({connection})" if connection else "", outage_limit)
    traced = tracing.configure("trajbus-worker", settings.tracing, servers, traces_topic(settings.topics.prefix))
    with tempfile.TemporaryDirectory(prefix=f"trajbus-{settings.app_id}-") as datadir:
        metrics = WorkerMetrics()
        chores = WorkerChores(settings, servers, metrics)  # started once the topics exist
        app = build_app(servers, settings, Path(datadir), metrics, chores)
        changelog = changelog_topic_name(app)
        _provision(servers, worker_topics(settings, changelog), outage_limit,
                   check=partial(_match_partitions, servers, settings, changelog))
        # Faust applies its loglevel to the handler, so the handler takes INFO and the
        # logger configuration decides what each library may say.
        worker = faust.Worker(app, loglevel="INFO", quiet=True, redirect_stdouts=False,
                              logging_config=logging_config(settings.faust_loglevel, level))
        chores.start()
        outage = OutageWatch(servers, outage_limit, _give_up, what="worker").start()
        try:
            worker.execute_from_commandline()
        except SystemExit:
            if _gave_up:
                raise KafkaUnreachable(_gave_up[0]) from None
            crash = worker.crash_reason or app.crash_reason
            if not lost_kafka(crash):
                raise
            log.warning("worker lost kafka (%r); starting again once it answers", crash)
        finally:
            outage.stop()
            chores.close()  # the last statistics out, then the policy watcher and the metrics server
            traced.shutdown()  # the last spans out (also before a restart)
    os.environ[OUTAGE_SINCE] = str(time.time())
    logging.shutdown()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
