"""A wrong address is one error naming it, in bounded time (issue 36), never an outage ridden through.

A cluster no client of this process has reached yet may be a wrong address: a first contact waits up to
``CONNECT_TIMEOUT`` for its answer and raises ``ClusterNotReached``; meanwhile the outage line is held back,
so the error is the only line. A cluster reached once keeps the two lines of an outage (``test_logs``).
Without a broker: a refused port (nobody listens) and a scripted probe.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from tests.helpers import wait_for
from tests.unit.test_logs import GatedProbe
from trajbus.infra import outage
from trajbus.infra.first_contact import ClusterNotReached, first_contact
from trajbus.infra.outage import ClusterOutage, KafkaUnreachable
from trajbus.streams.client.producer import StepProducer, TopicsUnavailable
from trajbus.streams.wire.records import Step

NOBODY = "127.0.0.1:1"  # nobody listens


def loud(caplog) -> list[str]:
    """What a terminal at default verbosity shows of trajbus's records."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def test_an_outage_of_a_cluster_never_answered_is_the_first_contact_s_to_tell(caplog, monkeypatch):
    monkeypatch.setattr(outage, "PROBE_INTERVAL", 0.01)
    up = threading.Event()
    cluster = ClusterOutage("wrong:9092", probe=lambda servers: GatedProbe(up))
    with caplog.at_level(logging.DEBUG, logger="trajbus"):
        with cluster.contacting():
            cluster.all_brokers_down()
            wait_for(lambda: cluster.down_since is not None, 5, "the probe to confirm it", interval=0.01)
            cluster.not_reached()  # the contact gave up: its error is the line
        for _ in range(5):  # the clients still retrying, after the error
            cluster.all_brokers_down()
        up.set()
        wait_for(lambda: cluster.answered, 5, "the cluster to answer", interval=0.01)
        assert loud(caplog) == [], "no outage began or ended: none was told"
        up.clear()
        cluster.all_brokers_down()  # a cluster reached once: an outage as any
        wait_for(lambda: loud(caplog), 5, "the outage line", interval=0.01)
        up.set()
        wait_for(lambda: len(loud(caplog)) == 2, 5, "the outage's end", interval=0.01)
        cluster._watcher.join(5)
    began, ended = loud(caplog)
    assert began.startswith("Kafka outage began: no broker of wrong:9092") and ended.startswith("Kafka outage ended")


def test_a_first_contact_at_an_address_nobody_answers_is_one_error_naming_it(caplog):
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="trajbus"):
        with pytest.raises(ClusterNotReached) as error:
            first_contact(NOBODY, timeout=0.5)
        assert time.monotonic() - started < 5, "a first contact gives up at its timeout"
        assert isinstance(error.value, KafkaUnreachable)
        assert str(error.value).startswith(f"no Kafka broker answers at {NOBODY} within 0.5s (Connect to ")
        assert "Connection refused" in str(error.value) and "KafkaError{" not in str(error.value)
        time.sleep(outage.PROBE_INTERVAL * 2)  # the outage probe, still at work after the error, says nothing
    assert loud(caplog) == []


def test_a_producer_s_first_call_waits_connect_timeout_at_most_whatever_its_timeout(monkeypatch):
    monkeypatch.setattr("trajbus.streams.client.producer.CONNECT_TIMEOUT", 0.5)
    step = Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p")
    started = time.monotonic()
    with StepProducer(NOBODY, timeout=30) as producer:
        with pytest.raises(TopicsUnavailable, match=rf"^no Kafka broker answers at {NOBODY} within 0.5s"):
            producer.submit_steps([step])
    assert time.monotonic() - started < 10, "the first call's wait is CONNECT_TIMEOUT, not the call's 30 s"
