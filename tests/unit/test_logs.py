"""What a newcomer's terminal shows while a broker is down: an outage in two lines (began, ended), each
connection attempt at DEBUG, and a library's repeated reconnect line once, not per attempt."""

from __future__ import annotations

import logging
import threading

from confluent_kafka import KafkaError

from tests.conftest import raw_librdkafka_lines
from tests.helpers import wait_for
from trajbus.infra import outage
from trajbus.infra.client_roles import ClientLog
from trajbus.infra.clients import ClientErrors
from trajbus.infra.logs import RepeatFilter
from trajbus.infra.outage import ClusterOutage


def record(name: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, None)


def test_a_client_repeating_itself_is_heard_once_per_window():
    repeats = RepeatFilter(window=60)
    fail = "FAIL [rdkafka#producer-1] [thrd:127.0.0.1:9092/1]: Connect to ipv4#127.0.0.1:9092 failed (after {}ms)"
    assert repeats.filter(record("streams.client.producer", fail.format(0)))
    assert not repeats.filter(record("streams.client.producer", fail.format(3)))  # the same line, other numbers
    assert repeats.filter(record("streams.client.producer", "FAIL [rdkafka#producer-1] [thrd:main]: all brokers are down"))
    assert repeats.filter(record("aiokafka.conn", "Unable connect to node with id 1"))
    assert not repeats.filter(record("aiokafka.conn", "Unable connect to node with id 1"))


def test_our_own_lines_always_pass():
    repeats = RepeatFilter(window=60)
    line = "waiting for kafka at 127.0.0.1:9092 (outage 3s of 120s)"
    assert repeats.filter(record("trajbus.worker", line)) and repeats.filter(record("trajbus.worker", line))


# -- an outage is two lines (issue 35) -----------------------------------------------------------------


class GatedProbe:
    """The cluster is down until ``up`` is set."""

    def __init__(self, up: threading.Event) -> None:
        self.up = up

    def check(self) -> str | None:
        return None if self.up.is_set() else "Failed to get metadata: Local: Broker transport failure"

    def close(self) -> None:
        pass


def outage_lines(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == outage.__name__]


def wait_until(condition, timeout: float = 5.0) -> None:
    wait_for(condition, timeout, "the outage probe", interval=0.01)


def test_an_outage_is_one_line_when_it_begins_and_one_when_it_ends(caplog, monkeypatch):
    monkeypatch.setattr(outage, "PROBE_INTERVAL", 0.01)
    up = threading.Event()
    cluster = ClusterOutage("b1:9092,b2:9092", probe=lambda servers: GatedProbe(up))
    with caplog.at_level(logging.DEBUG, logger="trajbus"):
        cluster.failure("Connect to ipv4#10.0.0.1:9092 failed: Connection refused")
        assert outage_lines(caplog) == []  # one failed attempt is not an outage: a broker of several may be down
        cluster.all_brokers_down()
        wait_until(lambda: outage_lines(caplog))
        for _ in range(20):  # every client, every attempt
            cluster.all_brokers_down()
            cluster.failure("Connect to ipv4#10.0.0.1:9092 failed: Connection refused")
        assert cluster.down_since is not None
        up.set()
        wait_until(lambda: len(outage_lines(caplog)) == 2)
        cluster._watcher.join(5)
    (began_level, began), (ended_level, ended) = outage_lines(caplog)
    assert began_level == "WARNING" and "Kafka outage began" in began and "b1:9092,b2:9092" in began
    assert "Connection refused" in began
    assert ended_level == "INFO" and "Kafka outage ended" in ended and " after " in ended
    assert cluster.down_since is None


def test_a_late_report_of_an_outage_already_over_says_nothing(caplog, monkeypatch):
    """A client polled only now serves its errors of an outage that ended meanwhile: the probe answers."""
    monkeypatch.setattr(outage, "PROBE_INTERVAL", 0.01)
    up = threading.Event()
    up.set()
    cluster = ClusterOutage("b:9092", probe=lambda servers: GatedProbe(up))
    with caplog.at_level(logging.DEBUG, logger="trajbus"):
        cluster.all_brokers_down()
        cluster._watcher.join(5)
    assert outage_lines(caplog) == []


def test_every_connection_attempt_is_a_debug_record_and_other_library_lines_keep_their_level(caplog):
    own = logging.getLogger("trajbus.streams.client.producer")
    client = ClientLog(own)
    attempts = [("FAIL", "[thrd:b:1/bootstrap]: b:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused "
                 "(after 0ms in state CONNECT)"),
                ("FAIL", "[thrd:b:1/1]: b:1/1: Disconnected: connection closed by peer (after 25072ms in state UP)"),
                ("ERROR", "[thrd:app]: rdkafka#producer-1: 1/1 brokers are down"),
                ("SESSTMOUT", "[thrd:main]: Consumer group session timed out: revoking assignment and rejoining group"),
                ("OFFSET", "[thrd:main]: Failed to fetch committed offsets: Local: Broker transport failure")]
    with caplog.at_level(logging.DEBUG, logger="trajbus"):
        for facility, text in attempts:
            client.log(logging.ERROR if facility in ("FAIL", "ERROR") else logging.WARNING, "%s [%s] %s", facility,
                       "rdkafka#producer-1", text)
        # a text no other test logs: a repeat of a line another test logged may be held back (infra.logs)
        client.log(logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "unknown property: test_logs")
    assert [r.levelname for r in caplog.records] == ["DEBUG"] * len(attempts) + ["WARNING"]


def test_a_client_that_lost_every_broker_asks_its_cluster_with_the_attempt_s_words(monkeypatch):
    errors = ClientErrors("127.0.0.1:1")
    calls = []
    monkeypatch.setattr(errors.outage, "all_brokers_down", lambda: calls.append("down"))
    monkeypatch.setattr(errors.outage, "failure", lambda reason: calls.append(reason))
    errors(KafkaError(KafkaError._TRANSPORT, "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: "
                                             "Connection refused (after 0ms in state CONNECT)"))
    errors(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert calls == ["Connect to ipv4#127.0.0.1:1 failed: Connection refused", "down"]


def test_raw_librdkafka_lines_are_told_from_logged_ones():
    assert raw_librdkafka_lines(
        "%4|1732420000.123|GETPID|rdkafka#producer-1| [thrd:main]: Coordinator load in progress: retrying\n"
        "FAIL [rdkafka#producer-4] [thrd:b:1/bootstrap]: Connect to ipv4#127.0.0.1:1 failed\n"
        "2026-11-24 04:04:02,538 WARNING trajbus.kafka CONFWARN [rdkafka#producer-1] unknown property\n"
        "Kafka outage began: no broker of 127.0.0.1:1 answers\n") == [
        "%4|1732420000.123|GETPID|rdkafka#producer-1| [thrd:main]: Coordinator load in progress: retrying",
        "FAIL [rdkafka#producer-4] [thrd:b:1/bootstrap]: Connect to ipv4#127.0.0.1:1 failed"]
