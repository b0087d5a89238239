"""The producer's waiting, without a broker: a call settles on its own delivery reports, and a call nobody
acknowledges fails as ``DeliveryError`` (or ``TopicsUnavailable``), from threads and coroutines alike."""

from __future__ import annotations

import asyncio
import threading

import pytest

from trajbus.streams.wire.prefix import PROMPT_FULL
from trajbus.streams.client.delivery import Acks, Poller
from trajbus.streams.client.producer import DeliveryError, StepProducer, TopicsUnavailable
from tests.unit.test_prefix import trajectory

NOBODY = "127.0.0.1:1"  # nobody listens


def reached(producer: StepProducer) -> StepProducer:
    """As a producer whose cluster answered its first call and went away since: its calls are sent, and fail
    on their acknowledgement (a producer that never reached its cluster fails before sending anything)."""
    producer._reached = True
    return producer


class FakeClient:
    """Serves the delivery reports it is handed, on the thread that polls it."""

    def __init__(self) -> None:
        self.reports: list[Acks] = []
        self.lock = threading.Lock()
        self.polled_on: set[str] = set()

    def poll(self, timeout: float) -> int:
        self.polled_on.add(threading.current_thread().name)
        with self.lock:
            reports, self.reports = self.reports, []
        for acks in reports:
            acks(None, None)
        if not reports:
            threading.Event().wait(timeout / 10)
        return len(reports)


def test_the_poll_thread_settles_each_call_on_its_own_reports_and_sleeps_when_none_is_in_flight():
    client = FakeClient()
    poller = Poller(client)
    calls = [Acks(2) for _ in range(3)]
    for acks in calls:
        poller.track(acks)
    assert poller.in_flight == 3
    with client.lock:
        client.reports += [calls[0], calls[0], calls[1]]
    assert calls[0].wait(5) and calls[0].delivered == 2
    assert not calls[1].settled and not calls[2].settled
    with client.lock:
        client.reports += [calls[1], calls[2], calls[2]]
    assert all(acks.wait(5) for acks in calls)
    assert poller.in_flight == 0
    assert client.polled_on == {"trajbus-producer-poll"}, "callers never poll"
    poller.stop()
    assert not poller.thread.is_alive()
    with pytest.raises(DeliveryError, match="closed"):
        poller.track(Acks(1))


def test_a_call_whose_producing_failed_part_way_settles_on_the_records_queued():
    settled = []
    acks = Acks(3, on_settled=lambda: settled.append(True))
    acks(None, None)
    acks.expect(2)  # the third record was never queued
    assert not acks.settled
    acks(None, None)
    assert acks.settled and settled == [True] and acks.delivered == 2
    nothing = Acks(2)
    nothing.expect(0)
    assert nothing.settled


def test_an_async_call_nobody_acknowledges_raises_and_the_trajectorys_next_step_is_written_whole():
    first, second = trajectory("t", 3)[:2]
    with reached(StepProducer(NOBODY, timeout=0.5, provision_topics=False)) as producer:
        with pytest.raises(DeliveryError, match="1 of 1 records .* not acknowledged within 0.5s"):
            asyncio.run(producer.submit_steps_async([first], channel="train"))
        assert producer._prefixes.delta(second).kind == PROMPT_FULL  # step 0 may never have arrived
        with pytest.raises(DeliveryError, match="not acknowledged"):
            asyncio.run(producer.complete_trajectory_async("t", "p", channel="train"))


def test_a_cancelled_async_call_forgets_its_trajectories_as_a_failed_one_does():
    first, second = trajectory("t", 3)[:2]

    async def cancelled(producer: StepProducer) -> None:
        call = asyncio.ensure_future(producer.submit_steps_async([first], channel="train"))
        await asyncio.sleep(0)  # the call runs to its wait for the acknowledgement (nothing before it waits)
        assert producer._poller.in_flight == 1 and not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    with reached(StepProducer(NOBODY, timeout=1.5, provision_topics=False)) as producer:
        asyncio.run(cancelled(producer))
        assert producer._prefixes.delta(second).kind == PROMPT_FULL


def test_an_async_call_to_an_unreachable_broker_raises_topics_unavailable():
    with reached(StepProducer(NOBODY, timeout=0.5)) as producer:
        with pytest.raises(TopicsUnavailable, match="^topics of channel 'train' not provisioned: Failed to get "
                                                    "metadata"):  # the error's words, not KafkaError{...}
            asyncio.run(producer.submit_steps_async(trajectory("t", 1), channel="train"))
        assert not producer.is_provisioned("train")


@pytest.mark.parametrize("provision_topics", [True, False])
def test_a_first_call_to_an_address_nobody_answers_names_it_and_sends_nothing(provision_topics):
    """A wrong address: the first call says so within the producer's timeout (at most ``CONNECT_TIMEOUT``),
    naming the address and the refused connection; nothing was queued, so nothing can land later."""
    with StepProducer(NOBODY, timeout=0.5, provision_topics=provision_topics) as producer:
        for call in (lambda: producer.submit_steps(trajectory("t", 1), channel="train"),
                     lambda: asyncio.run(producer.submit_steps_async(trajectory("t", 1), channel="train")),
                     lambda: producer.complete_trajectory("t", "p", channel="train")):
            with pytest.raises(TopicsUnavailable, match=rf"^no Kafka broker answers at {NOBODY} within 0.5s "
                                                        r"\(.*Connection refused\).*; nothing was sent$"):
                call()
        assert producer._poller.thread is None, "a record was queued"


@pytest.mark.parametrize("steps, says", [
    ({"prompt_ids": [1], "response_ids": [2], "trajectory_uid": "t", "prompt_uid": "p"}, "got a single dict"),
    (trajectory("t", 1)[0], "got a single Step"),
])
def test_a_single_step_instead_of_a_list_is_told_to_be_a_list(steps, says):
    with StepProducer(NOBODY, timeout=0.5) as producer:
        for call in (lambda: producer.submit_steps(steps), lambda: asyncio.run(producer.submit_steps_async(steps))):
            with pytest.raises(ValueError, match=rf"^steps: expected a list of steps, {says}; pass a list, "
                                                 r"e.g. submit_steps\(\[step\]\)$"):
                call()
        with pytest.raises(ValueError, match="^steps: expected a list of steps .Step or dict., got int$"):
            producer.submit_steps(5)
