"""The worker's group look-up (``streams.worker.membership.group_size``) against a real broker.

It counts the group's members, and a broker that does not answer makes it raise within its timeout:
the look-up is a pure-Python client's, so a timed-out request can never abort the worker's process as
librdkafka's did (confluentinc/librdkafka#4605; the worker survives broker kills because of it).
"""

from __future__ import annotations

import threading

from trajbus.infra.clients import trainer_consumer
from trajbus.infra.local import free_port
from trajbus.infra.topics import TopicSpec, ensure_topics
from trajbus.streams.worker.membership import group_size
from tests.helpers import wait_for


def test_the_look_up_counts_the_members_of_a_group(bootstrap_servers: str, prefix: str):
    topic, group = f"{prefix}.membership", f"{prefix}-membership"
    ensure_topics(bootstrap_servers, [TopicSpec(topic, 2)])
    consumer = trainer_consumer(bootstrap_servers, group)
    try:
        consumer.subscribe([topic])
        wait_for(lambda: consumer.poll(0.2) is None and consumer.assignment(), 60, "the consumer's assignment")
        assert group_size(bootstrap_servers, group) == 1
    finally:
        consumer.close()


def test_a_broker_that_does_not_answer_is_an_exception_not_an_abort():
    outcome: list[BaseException | int] = []

    def look_up() -> None:
        try:
            outcome.append(group_size(f"127.0.0.1:{free_port()}", "nobody-listens", timeout=1.0))
        except Exception as exc:  # noqa: BLE001 - what the worker's announcement catches
            outcome.append(exc)

    thread = threading.Thread(target=look_up, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the look-up did not give up on a closed port"
    assert len(outcome) == 1 and isinstance(outcome[0], Exception), outcome
