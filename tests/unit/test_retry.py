"""The one retry policy (infra.retry): refusals that say when to ask again, and retries a caller stops;
the gateway's connection to Kafka under it, bounded by --broker-outage-limit."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from trajbus.gateway.broker import kafka_link
from trajbus.gateway.config import GatewaySettings
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.infra.retry import RetryLater, Stopped, retrying, retrying_when_told
from tests.helpers import wait_for

log = logging.getLogger(__name__)


def test_a_refusal_is_asked_again_after_the_wait_it_names_until_accepted():
    asked: list[float] = []
    started = time.monotonic()
    for attempt in retrying_when_told(threading.Event()):
        with attempt:
            asked.append(time.monotonic() - started)
            if len(asked) < 3:
                raise RetryLater("paced", after=0.15)
    assert len(asked) == 3
    assert asked[1] - asked[0] >= 0.14 and asked[2] - asked[1] >= 0.14, asked


def test_a_stop_during_the_wait_raises_the_refusal_at_once_and_asks_no_more():
    stopped, asked = threading.Event(), []
    threading.Timer(0.2, stopped.set).start()
    started = time.monotonic()
    with pytest.raises(RetryLater, match="paced"):
        for attempt in retrying_when_told(stopped):
            with attempt:
                asked.append(1)
                raise RetryLater("paced", after=30.0)
    assert len(asked) == 1 and time.monotonic() - started < 5


def test_a_stopped_retry_ends_its_wait_with_stopped():
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started, tries = time.monotonic(), []
    with pytest.raises(Stopped):
        for attempt in retrying(60.0, log, "test", first_wait=30.0, stop=stop):
            with attempt:
                tries.append(1)
                raise ConnectionError("down")
    assert len(tries) == 1 and time.monotonic() - started < 5


def _link(monkeypatch, limit: float, gave_up: list[str]) -> kafka_link.KafkaLink:
    def unreachable(_servers):
        raise ConnectionError("no broker answers")

    monkeypatch.setattr(kafka_link, "resolve_bootstrap_servers", unreachable)
    monkeypatch.setattr(kafka_link, "authentication_failure", lambda _servers: None)
    settings = GatewaySettings(vllm_addresses=["http://127.0.0.1:1"], tokenizer_path="unused",
                               bootstrap_servers="127.0.0.1:1", broker_outage_limit=limit)
    return kafka_link.KafkaLink(settings, GatewayMetrics("test", "http://test"), lambda _servers: None,
                                gave_up.append)


def test_a_gateway_that_never_connects_gives_up_past_the_outage_limit(monkeypatch):
    gave_up: list[str] = []
    link = _link(monkeypatch, 1.0, gave_up)
    started = time.monotonic()
    link.start()
    wait_for(lambda: gave_up, 15, "the gateway to give up connecting")
    assert time.monotonic() - started < 8
    assert "--broker-outage-limit" in gave_up[0] and "no broker answers" in gave_up[0], gave_up
    assert link.missing() == "Kafka not reachable: no broker answers"  # what /ready said meanwhile
    link.close()


def test_a_closed_gateway_stops_connecting_and_does_not_give_up(monkeypatch):
    gave_up: list[str] = []
    link = _link(monkeypatch, 2.0, gave_up)
    link.start()
    wait_for(lambda: link.error.startswith("Kafka not reachable"), 10, "a failed try")
    link.close()
    wait_for(lambda: not any(t.name == "kafka-connect" and t.is_alive() for t in threading.enumerate()), 10,
             "the connecting thread to end")
    assert gave_up == []
