"""An outage in trajbus's client logs is two lines (began, ended), never librdkafka's lines per attempt.

Issue 35: during one 20 s outage a user's ``StepProducer`` printed 80 raw ``FAIL [rdkafka#producer-4] ...
Connection refused`` lines, and a ``BatchConsumer`` at a wrong address 194 in 5 s. Every client trajbus
builds says "outage began" once (naming the bootstrap servers) and "outage ended" once (with its duration);
each connection attempt is a DEBUG record.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap

from trajbus.consumers import BatchConsumer
from trajbus.pipelines.processes import free_port
from trajbus.streams.producer import StepProducer
from trajbus.streams.records import Step
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
    from trajbus.consumers import BatchConsumer
    from trajbus.streams.producer import DeliveryError, StepProducer
    from trajbus.streams.records import Step

    servers = sys.argv[1]
    producer = StepProducer(servers, timeout=2, provision_topics=False)
    try:
        producer.submit_steps([Step(prompt_ids=[1], response_ids=[2], reward=0.0, trajectory_uid="t", prompt_uid="p",
                                    step_index=0, policy_version=0, is_last=True, metadata={})])
    except DeliveryError:
        pass
    producer.close()
    consumer = BatchConsumer("train", servers, outage_limit=None)
    assert consumer.fetch_batch(timeout=2) is None
    consumer.close()
    print("done")
""")


def test_user_code_at_a_dead_address_prints_one_outage_line_and_no_librdkafka_line(tmp_path):
    """As a user runs it: no logging set up, so whatever a library logs at WARNING reaches stderr bare."""
    servers = f"127.0.0.1:{free_port()}"  # nothing listens there
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    done = subprocess.run([sys.executable, str(script), servers], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-3000:]
    raw = RAW_LIBRDKAFKA.findall(done.stderr)
    assert not raw, f"{len(raw)} raw librdkafka lines on stderr, e.g. {done.stderr.splitlines()[0]!r}"
    began = [line for line in done.stderr.splitlines() if "Kafka outage began" in line]
    assert len(began) == 1 and servers in began[0], done.stderr[-3000:]


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
