"""What a newcomer's terminal shows while a broker is down: a client's reconnect line once, not per attempt."""

from __future__ import annotations

import logging

from trajbus.infra.logs import RepeatFilter


def record(name: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, None)


def test_a_client_repeating_itself_is_heard_once_per_window():
    repeats = RepeatFilter(window=60)
    fail = "FAIL [rdkafka#producer-1] [thrd:127.0.0.1:9092/1]: Connect to ipv4#127.0.0.1:9092 failed (after {}ms)"
    assert repeats.filter(record("streams.producer", fail.format(0)))
    assert not repeats.filter(record("streams.producer", fail.format(3)))  # the same line, other numbers
    assert repeats.filter(record("streams.producer", "FAIL [rdkafka#producer-1] [thrd:main]: all brokers are down"))
    assert repeats.filter(record("aiokafka.conn", "Unable connect to node with id 1"))
    assert not repeats.filter(record("aiokafka.conn", "Unable connect to node with id 1"))


def test_our_own_lines_always_pass():
    repeats = RepeatFilter(window=60)
    line = "waiting for kafka at 127.0.0.1:9092 (outage 3s of 120s)"
    assert repeats.filter(record("trajbus.worker", line)) and repeats.filter(record("trajbus.worker", line))
