"""What a worker's terminal shows (issue 36): through an outage, trajbus's lines and not aiokafka's per
attempt; its periodic work waits without overlapping and says so once; its ready line says where it is,
how long it rides through an outage, and whom it shares its partitions with."""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import logging
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from trajbus.streams.worker import membership
from trajbus.streams.worker.membership import Membership, held_text, members_text, spans
from trajbus.streams.worker.periodic import every
from trajbus.streams.worker.logs import OVERLAPPING, ROUTINE, FailureStreak, RoutineClientLines, logging_config

LOGGER_MODULES = {"aiokafka": "aiokafka.client", "aiokafka.consumer.fetcher": "aiokafka.consumer.fetcher",
                  "aiokafka.consumer.group_coordinator": "aiokafka.consumer.group_coordinator",
                  "aiokafka.producer.sender": "aiokafka.producer.sender"}
"""The module that logs to each logger of ``ROUTINE``."""


class Captured(logging.Handler):
    def __init__(self, *filters: logging.Filter) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        for each in filters:
            self.addFilter(each)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def through(filter_: logging.Filter, lines: list[tuple[str, int, str, tuple]]) -> list[logging.LogRecord]:
    """Log ``lines`` (logger, level, template, arguments) through the real loggers into a handler with ``filter_``."""
    handler = Captured(filter_)
    for name, level, template, args in lines:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        try:
            logger.log(level, template, *args)
        finally:
            logger.removeHandler(handler)
    return handler.records


OUTAGE_AS_SEEN = [  # what a worker printed when its only broker was stopped (issue 36)
    ("aiokafka", logging.ERROR, "Unable connect to node with id %s: %s", (1, "[Errno 111] Connect call failed")),
    ("aiokafka", logging.ERROR, "Unable to update metadata from %s", ([1],)),
    ("aiokafka.consumer.fetcher", logging.ERROR, "Failed fetch messages from %s: %s", (1, "KafkaConnectionError")),
    ("aiokafka", logging.WARNING, "Unable to request metadata from node with id %s: %r", (1, "error")),
    ("aiokafka.consumer.group_coordinator", logging.ERROR,
     "Error sending %s to node %s [%s] -- marking coordinator dead", ("HeartbeatRequest", 1, "NodeNotReadyError")),
    ("aiokafka.consumer.group_coordinator", logging.WARNING, "Marking the coordinator dead (node %s)for group %s.",
     (1, "g")),
    ("aiokafka.consumer.group_coordinator", logging.ERROR, "Heartbeat send request failed: %s. Will retry.", ("e",)),
    ("aiokafka.consumer.group_coordinator", logging.ERROR, "Group Coordinator Request failed: %s", ("e",)),
    ("aiokafka.consumer.group_coordinator", logging.ERROR, "Heartbeat session expired - marking coordinator dead", ()),
    ("aiokafka.consumer.group_coordinator", logging.ERROR, "LeaveGroup request failed: %s", ("e",)),
    ("aiokafka.consumer.group_coordinator", logging.WARNING, "Heartbeat failed for group %s because it is rebalancing",
     ("g",)),
    ("mode.timers", logging.WARNING, "Timer %s is overlapping (interval=%r runtime=%r)", ("commit", 0.5, 34.5)),
]
REAL_ERRORS = [  # no retry mends these: they stay at their level
    ("aiokafka.consumer.fetcher", logging.ERROR, "Unexpected error in fetcher routine", ()),
    ("aiokafka.consumer.group_coordinator", logging.ERROR, "Unexpected error in coordinator routine", ()),
    ("aiokafka.consumer.group_coordinator", logging.ERROR, "Attempt to join group failed due to fatal error: %s",
     ("e",)),
    ("aiokafka.cluster", logging.ERROR, "Topic %s not found in cluster metadata", ("t",)),
    ("aiokafka.consumer.fetcher", logging.WARNING, "Not authorized to read from topic %s.", ("t",)),
    ("faust.transport.drivers.aiokafka", logging.ERROR, "Committing raised exception: %r", ("e",)),
    ("mode.timers", logging.WARNING, "Timer %s is overlapping (interval=%r runtime=%r)", ("Monitor.sampler", 1, 9)),
]


def test_aiokafka_attempts_during_an_outage_are_debug_records_and_real_errors_keep_their_level():
    shown = through(RoutineClientLines("WARNING"), OUTAGE_AS_SEEN + REAL_ERRORS)
    assert [(r.name, r.levelno, r.msg) for r in shown] == [(n, lv, t) for n, lv, t, _ in REAL_ERRORS]
    debug = through(RoutineClientLines("DEBUG"), OUTAGE_AS_SEEN)  # --faust-loglevel DEBUG shows every attempt
    assert len(debug) == len(OUTAGE_AS_SEEN) and {r.levelname for r in debug} == {"DEBUG"}


@pytest.mark.parametrize("name", sorted(ROUTINE))
def test_every_routine_template_is_one_the_installed_aiokafka_logs(name):
    """A template aiokafka no longer logs would let its new wording through: the list follows the library."""
    module = importlib.import_module(LOGGER_MODULES[name])
    strings = {node.value for node in ast.walk(ast.parse(inspect.getsource(module)))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert ROUTINE[name] <= strings, sorted(ROUTINE[name] - strings)


def test_the_timer_lines_are_the_installed_ones():
    import faust.transport.consumer
    import mode.timers

    assert OVERLAPPING in inspect.getsource(mode.timers)
    assert 'itertimer(interval, name="commit")' in inspect.getsource(faust.transport.consumer)


def test_the_worker_configuration_filters_the_handler_and_honours_trajbus_v():
    config = logging_config("warning", logging.DEBUG)
    assert config["root"]["level"] == logging.DEBUG
    assert config["handlers"]["stderr"]["filters"][0] == "routine"
    assert config["filters"]["routine"]["level"] == "WARNING" and config["loggers"]["aiokafka"]["level"] == "WARNING"
    assert config["loggers"]["kafka"]["level"] == "CRITICAL"  # the group look-up's client: its failure is ours to say
    assert logging_config("debug")["loggers"]["kafka"]["level"] == "DEBUG"


# -- periodic work: told once per streak, never overlapping ------------------------------------------------


def kafka_down() -> KafkaException:
    return KafkaException(KafkaError(KafkaError._ALL_BROKERS_DOWN, "Failed to get watermark offsets"))


def lines(caplog) -> list[tuple[str, str, bool]]:
    return [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records if r.name == "t"]


def test_a_kafka_outage_is_one_warning_without_traceback_per_streak(caplog):
    now = [0.0]
    streak = FailureStreak("periodic work", logging.getLogger("t"), clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="t"):
        for _ in range(10):
            now[0] += 1
            streak.failed(kafka_down())
        streak.succeeded()
        streak.succeeded()
        streak.failed(RuntimeError("resume point unknown after 8s"))  # a bug, not Kafka: an error each time
        streak.failed(RuntimeError("resume point unknown after 8s"))
        streak.failed(ConnectionError("leader moved"))  # the next streak
    seen = lines(caplog)
    warnings = [line for line in seen if line[0] == "WARNING"]
    assert warnings == [("WARNING", "periodic work waits for Kafka (Failed to get watermark offsets); retrying "
                                    "until it answers", False),
                        ("WARNING", "periodic work waits for Kafka (ConnectionError: leader moved); retrying until "
                                    "it answers", False)]
    assert sum(1 for level, _, traced in seen if level == "DEBUG" and traced) == 11, "each failure's traceback"
    assert [m for level, m, _ in seen if level == "INFO"] == ["periodic work resumed after 9s (10 failed tries)"]
    assert [(level, traced) for level, _, traced in seen if level == "ERROR"] == [("ERROR", True)] * 2


class FakeApp:
    """What ``periodic.every`` uses of a Faust app: ``task``, ``sleep``, ``should_stop``."""

    def __init__(self, runs: int) -> None:
        self.tasks: list = []
        self.runs, self.events = runs, []

    @property
    def should_stop(self) -> bool:
        return self.runs <= 0

    def task(self, fun):
        self.tasks.append(fun)
        return fun

    async def sleep(self, seconds: float) -> None:
        self.events.append(("sleep", seconds))
        await asyncio.sleep(0)


def test_periodic_work_sleeps_its_interval_after_each_run_however_long_the_run(caplog):
    """Faust's timer warned "Timer ... is overlapping" when a run outlasted its interval; a loop that
    sleeps between runs has nothing to overlap, and a failed run is told once and tried again."""
    app = FakeApp(runs=3)

    async def slow_job() -> None:
        app.events.append(("run",))
        app.runs -= 1
        await asyncio.sleep(0.05)  # 50 intervals long
        if app.runs:
            raise kafka_down()

    with caplog.at_level(logging.DEBUG, logger="trajbus.worker"):
        streak = every(app, 0.001, slow_job, "the job")
        asyncio.run(app.tasks[0]())
    assert app.events == [("sleep", 0.001), ("run",)] * 3
    assert streak.since is None, "the last run succeeded"
    worker_lines = [r.levelname for r in caplog.records if r.name == "trajbus.worker" and r.levelno >= logging.INFO]
    assert worker_lines == ["WARNING", "INFO"]
    assert not [r for r in caplog.records if "overlapping" in r.getMessage()]


# -- the ready line and the group --------------------------------------------------------------------------


def test_partitions_and_group_share_in_words():
    assert spans([3, 0, 1, 2, 6, 8, 9]) == "0-3,6,8-9"
    assert held_text({"train": {4, 5, 6, 7}}, ("train", "val")) == "train 4-7, val none"
    assert members_text("p-worker-train", 1) == "the only worker of group p-worker-train"
    assert members_text("p-worker-train", 2) == \
        "one of 2 workers of group p-worker-train, which share the steps partitions"
    assert "size unknown" in members_text("p-worker-train", None)


def test_the_first_assignment_is_the_ready_line_and_a_second_worker_says_it_shares(caplog, monkeypatch):
    settings = SimpleNamespace(app_id="p-worker-train", channels=("train",), topics=SimpleNamespace(prefix="p"),
                               broker_outage_limit=120.0)
    assembler = SimpleNamespace(settings=settings, bootstrap_servers="127.0.0.1:9092")
    recovered = asyncio.Event()
    held = [{"train": set(range(8))}]
    app = SimpleNamespace(rebalancing=False, tables=SimpleNamespace(recovery=SimpleNamespace(completed=recovered)))
    monkeypatch.setattr(membership, "held_by_channel", lambda app, prefix, channels: held[0])
    members = [1]
    monkeypatch.setattr(membership, "group_size", lambda servers, group: members[0])
    worker = Membership(app, assembler)
    with caplog.at_level(logging.INFO, logger="trajbus.worker"):
        asyncio.run(worker.announce())
        worker.assigned()
        asyncio.run(worker.announce())  # the table not yet recovered: not ready
        recovered.set()
        asyncio.run(worker.announce())
        asyncio.run(worker.announce())  # once per assignment
        held[0], members[0] = {"train": {4, 5, 6, 7}}, 2
        worker.assigned()
        asyncio.run(worker.announce())
    ready, rebalanced = [r.getMessage() for r in caplog.records if r.name == "trajbus.worker"]
    assert ready == ("worker ready: bootstrap 127.0.0.1:9092, prefix p, channels train; the only worker of group "
                     "p-worker-train; holds steps partitions train 0-7; rides through a Kafka outage for up to 120s "
                     "(--broker-outage-limit)")
    assert rebalanced == ("rebalanced: one of 2 workers of group p-worker-train, which share the steps partitions; "
                          "holds steps partitions train 4-7")


def test_a_rebalance_during_an_outage_is_announced_once_kafka_answers_without_a_look_up_before(caplog,
                                                                                              monkeypatch):
    """librdkafka aborts the process when a DescribeGroups request that timed out meets a broker coming
    back (confluentinc/librdkafka#4605): no group look-up while the cluster is known to be away."""
    from trajbus.infra.outage import cluster_outage

    servers = "127.0.0.1:9"  # the process's ClusterOutage of this address, this test's own
    settings = SimpleNamespace(app_id="p-worker-train", channels=("train",), topics=SimpleNamespace(prefix="p"),
                               broker_outage_limit=120.0)
    recovered = asyncio.Event()
    recovered.set()
    app = SimpleNamespace(rebalancing=False, tables=SimpleNamespace(recovery=SimpleNamespace(completed=recovered)))
    monkeypatch.setattr(membership, "held_by_channel", lambda app, prefix, channels: {"train": {0, 1}})
    look_ups: list[str] = []
    monkeypatch.setattr(membership, "group_size", lambda servers, group: look_ups.append(group) or 1)
    worker = Membership(app, SimpleNamespace(settings=settings, bootstrap_servers=servers))
    outage = cluster_outage(servers)
    with caplog.at_level(logging.INFO, logger="trajbus.worker"):
        outage.failed("refused")
        worker.assigned()
        asyncio.run(worker.announce())
        assert look_ups == [] and worker.pending
        outage.reached()
        asyncio.run(worker.announce())
    assert look_ups == ["p-worker-train"] and not worker.pending
    assert [r.getMessage() for r in caplog.records if r.name == "trajbus.worker"][0].startswith(
        "worker ready: bootstrap 127.0.0.1:9, prefix p, channels train; the only worker of group p-worker-train")


def test_direct_reads_after_a_rebalance_are_one_warning(caplog):
    """After a broker restart every partition has a range Faust skipped, read directly: the recovery
    working, told once per rebalance (each partition at DEBUG)."""
    from tests.unit.worker_fakes import new_worker

    worker = new_worker(partitions=range(8)).assembler.recovery  # its direct reads find nothing
    with caplog.at_level(logging.DEBUG, logger="trajbus.worker"):
        for partition in range(8):
            asyncio.run(worker.apply_range("train", partition, 12, 36, "skipped by the consumer"))
        worker.forget()  # the next rebalance
        asyncio.run(worker.apply_range("train", 0, 36, 40, "skipped by the consumer"))
    levels = [r.levelname for r in caplog.records if "reading them directly" in r.getMessage()]
    assert levels == ["WARNING"] + ["DEBUG"] * 7 + ["WARNING"]
