"""The one rule of riding through an outage (infra.outage.OutageWatch), shared by the services and the
trainer's BatchConsumer: down from the first unanswered probe, given up past the limit, reset by an answer."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from trajbus.consumers import batch_consumer
from trajbus.consumers.batch_consumer import BatchConsumer
from trajbus.infra import outage
from trajbus.infra.outage import KafkaUnreachable, OutageWatch


class Clock:
    """``time`` as the rule reads it, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def test_an_outage_counts_from_the_first_unanswered_probe_and_gives_up_past_the_limit(monkeypatch):
    clock, answers = Clock(), [True, False, False, False, True, False]
    monkeypatch.setattr(outage, "time", clock)
    watch = OutageWatch("rule-test:9092", limit=10.0, what="trainer", setting="outage_limit", consequence=None,
                        reachable=lambda timeout: answers.pop(0))
    assert watch.interval == 2.5  # a quarter of the limit: given up within ~1.25x of it
    assert watch.check() is None and watch.down_since is None
    assert watch.check() is None and watch.down_since == clock.now  # the first unanswered probe
    clock.now += 10.0
    assert watch.check() is None  # at the limit, not past it
    clock.now += 0.5
    assert watch.check() == "Kafka unreachable for 10s (outage_limit 10)"
    assert watch.check() is None and watch.down_since is None  # answered: the count starts again
    assert watch.check() is None


def test_a_service_s_watch_says_what_it_does_past_the_limit(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(outage, "time", clock)
    watch = OutageWatch("rule-test-2:9092", limit=8.0, reachable=lambda timeout: False)
    watch.check()
    clock.now += 9.0
    assert watch.check() == ("Kafka unreachable for 9s (--broker-outage-limit 8); exiting for a supervisor to "
                             "restart it")


def test_a_trainer_fetching_through_an_outage_gives_up_within_its_limit_by_the_same_rule(monkeypatch):
    monkeypatch.setattr(batch_consumer, "first_contact", lambda servers, timeout: None)  # reached once, then lost
    with BatchConsumer("train", "127.0.0.1:1", prefix="outage-rule", outage_limit=1.0,
                       log_level=0) as trainer:
        started = time.monotonic()
        with pytest.raises(KafkaUnreachable, match=r"unreachable for \d+s \(outage_limit 1\): no broker of "
                                                   r"127\.0\.0\.1:1 answers"):
            trainer.fetch_group(timeout=None)
    assert time.monotonic() - started < 4.5, "probed every quarter of the limit, not every 5 s"


EXITING_WITH_A_PROBE = r'''
import threading
from trajbus.infra import outage

built = threading.Event()

class Probe:
    def __init__(self, servers):
        print("probe built", flush=True)
        built.set()
    def check(self):
        threading.Event().wait(0.05)
        return "connection refused"
    def close(self):
        print("probe closed", flush=True)

cluster = outage._clusters["127.0.0.1:9"] = outage.ClusterOutage("127.0.0.1:9", probe=Probe)
cluster.all_brokers_down()  # a client lost every broker: the probe starts, on a daemon thread
assert built.wait(10), "the probe never started"
print("exiting", flush=True)
'''


def test_a_probe_running_when_the_process_exits_is_stopped_and_closed_first():
    """A probe left running at exit was a librdkafka client mid-handshake while the interpreter and OpenSSL were
    torn down (a CLI that had said why it failed crashed, -11): the exit stops it and closes it before the process
    ends."""
    done = subprocess.run([sys.executable, "-c", EXITING_WITH_A_PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["probe built", "exiting", "probe closed"], done.stdout + done.stderr
