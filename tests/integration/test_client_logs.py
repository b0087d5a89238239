"""An outage in trajbus's client logs is two lines (began, ended), never librdkafka's lines per attempt;
a wrong address is one error naming it, in bounded time.

Issue 35: during one 20 s outage a user's ``StepProducer`` printed 80 raw ``FAIL [rdkafka#producer-4] ...
Connection refused`` lines, and a ``BatchConsumer`` at a wrong address 194 in 5 s. Every client trajbus
builds says "outage began" once (naming the bootstrap servers) and "outage ended" once (with its duration);
each connection attempt is a DEBUG record. Issue 36: at a wrong address the producer raised after 30 s, a
fetch returned ``None`` after 10 s (as if no group were ready) and ``trajbus stats`` printed a raw
``KafkaError{...}``; now each says, once, that no broker answers at that address.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

from trajbus.consumers import BatchConsumer
from trajbus.pipelines.processes import free_port
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import Step
from tests.helpers import wait_for

RAW_LIBRDKAFKA = re.compile(r"rdkafka#|^%\d\|", re.M)
"""A line librdkafka printed itself (``%4|...``), or its line as Python's last-resort handler prints it."""


def step(uid: str) -> Step:
    return Step(prompt_ids=[1, 2], response_ids=[3], reward=1.0, trajectory_uid=f"{uid}-t", prompt_uid=uid,
                step_index=0, policy_version=0, is_last=True, metadata={})


def outage_lines(caplog, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"Kafka outage {word}" in r.getMessage()]


USER_SCRIPT = textwrap.dedent("""
    import sys
    import time

    from trajbus.consumers import BatchConsumer
    from trajbus.infra.first_contact import ClusterNotReached
    from trajbus.streams.client.producer import StepProducer, TopicsUnavailable
    from trajbus.streams.wire.records import Step

    wrong, right, prefix = sys.argv[1:]
    step = Step(prompt_ids=[1], response_ids=[2], reward=0.0, trajectory_uid="t", prompt_uid="p", is_last=True)

    def timed(what, call):
        started = time.monotonic()
        try:
            result = call()
        except (TopicsUnavailable, ClusterNotReached) as exc:
            result = f"{type(exc).__name__}: {exc}"
        print(f"{what} {time.monotonic() - started:.1f} {result}", flush=True)

    with StepProducer(wrong, timeout=2) as producer:
        timed("submit", lambda: producer.submit_steps([step]))
    with BatchConsumer("train", wrong, connect_timeout=2) as consumer:
        timed("fetch", lambda: consumer.fetch_batch(timeout=1))
    with StepProducer(right, prefix=prefix) as producer:
        timed("submit", lambda: producer.submit_steps([step]))
    with BatchConsumer("train", right, prefix=prefix) as consumer:
        timed("fetch", lambda: consumer.fetch_batch(timeout=1))
""")


def test_user_code_at_a_wrong_address_gets_one_error_naming_it_and_nothing_else(bootstrap_servers, prefix, tmp_path):
    """As a user runs it, no logging set up (whatever a library logs at WARNING reaches stderr bare): at a
    wrong address, the producer's first call and the consumer's first fetch each raise one error naming it,
    within their bounds (2 s asked); at the right address, a fetch with no group ready is ``None``."""
    wrong = f"127.0.0.1:{free_port()}"  # nothing listens there
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    done = subprocess.run([sys.executable, str(script), wrong, bootstrap_servers, prefix], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", f"a line besides the errors: {done.stderr[:2000]}"
    said = [line.split(" ", 2) for line in done.stdout.splitlines()]
    assert [what for what, _, _ in said] == ["submit", "fetch", "submit", "fetch"], done.stdout
    (_, submit_took, submit), (_, fetch_took, fetch), (_, _, acked), (_, _, nothing_ready) = said
    refused = rf"no Kafka broker answers at {re.escape(wrong)} within 2s \(Connect to .*Connection refused\); "
    assert re.fullmatch(rf"TopicsUnavailable: {refused}.*; nothing was sent", submit), submit
    assert re.fullmatch(rf"ClusterNotReached: {refused}.*", fetch), fetch
    assert float(submit_took) < 10 and float(fetch_took) < 10, done.stdout  # 2 s asked: a deadline, generous
    assert (acked, nothing_ready) == ("1", "None"), done.stdout


def test_a_broker_killed_and_restarted_is_one_outage_began_and_one_ended(own_broker, prefix, capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="trajbus")
    servers = own_broker.read_state().bootstrap_servers
    with StepProducer(servers, prefix=prefix, timeout=20) as producer, \
            BatchConsumer("train", servers, prefix=prefix, outage_limit=None) as trainer:
        producer.submit_steps([step("before")])
        trainer.fetch_group(timeout=1.0)  # joined, connected
        os.kill(own_broker.read_state().pid, signal.SIGKILL)
        wait_for(lambda: trainer.fetch_group(timeout=0.2) is None and outage_lines(caplog, "began"), 30,
                 "the outage's first line", interval=0)
        own_broker.start()
        producer.submit_steps([step("after")])  # acknowledged: the cluster is back
        wait_for(lambda: trainer.fetch_group(timeout=0.2) is None and outage_lines(caplog, "ended"), 30,
                 "the outage's last line", interval=0)
    began, ended = outage_lines(caplog, "began"), outage_lines(caplog, "ended")
    assert len(began) == 1 and servers in began[0], began
    assert len(ended) == 1 and re.search(r"after \d+\.\ds", ended[0]), ended
    attempts = [r for r in caplog.records if "rdkafka#" in r.getMessage()]
    assert attempts and all(r.levelno == logging.DEBUG for r in attempts if "Connect" in r.getMessage()), \
        "per-attempt connection lines are DEBUG"
    loud = [r.getMessage() for r in attempts if r.levelno >= logging.WARNING]
    assert not loud, f"librdkafka lines at WARNING or above (bare on a user's stderr): {loud[:3]}"
    captured = capfd.readouterr()
    assert not RAW_LIBRDKAFKA.search(captured.err + captured.out), captured.err[-2000:]


def test_stats_and_topics_at_a_wrong_address_say_so_in_one_line_and_exit_1(tmp_path):
    wrong = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    commands = {name: subprocess.Popen([sys.executable, "-m", "trajbus.pipelines.cli", name, "--bootstrap-servers",
                                        wrong, "--connect-timeout", "2"], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
                for name in ("stats", "topics")}
    for name, command in commands.items():
        out, err = command.communicate(timeout=60)
        assert command.returncode == 1, err[-2000:]
        assert out == "" and len(err.splitlines()) == 1, err[-2000:]
        assert err.startswith(f"trajbus {name}: no Kafka broker answers at {wrong} within 2s ("), err
        assert "Connection refused" in err and "KafkaError{" not in err and not RAW_LIBRDKAFKA.search(err), err
    assert time.monotonic() - started < 30, "both gave up at their --connect-timeout (2 s), not later"


def test_a_worker_at_a_wrong_address_says_how_long_it_waits_then_gives_up_in_one_line(tmp_path):
    wrong = f"127.0.0.1:{free_port()}"  # nothing listens there
    worker = subprocess.run([sys.executable, "-m", "trajbus.pipelines.cli", "worker", "--bootstrap-servers", wrong,
                             "--broker-outage-limit", "2"], capture_output=True, text=True, timeout=60)
    assert worker.returncode != 0, worker.stderr[-2000:]
    lines = worker.stderr.strip().splitlines()
    assert "waits up to 2s for it when unreachable: --broker-outage-limit" in lines[0], lines[0]
    assert lines[-1].startswith(f"trajbus worker: Kafka at {wrong} unreachable for"), lines[-1]
    assert "Broker transport failure" in lines[-1] and "KafkaError{" not in worker.stderr, lines[-1]
    assert not RAW_LIBRDKAFKA.search(worker.stderr) and "Traceback" not in worker.stderr, worker.stderr[-2000:]
