"""The producer at the gateway's call pattern on the real broker: one acknowledged step per call, from
coroutines (``submit_steps_async``, ``complete_trajectory_async``) and from threads at once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from trajbus.consumers import BatchConsumer
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import Step
from trajbus.streams.wire.topics import steps_topic
from tests.helpers import decode_step_events, end_offsets, fetch_groups, read_to_end
from tests.integration.test_prefix_sharing import multi_turn_groups, tokens


def test_one_step_calls_from_coroutines_are_acknowledged_without_a_thread_each(bootstrap_servers, prefix,
                                                                              start_worker):
    groups = multi_turn_groups(time.time() - 100)  # 2 groups x 2 rollouts x 5 turns
    for steps in groups["mt1"]:  # mt1's trajectories end by complete_trajectory_async, with the reward
        steps[-1].is_last = False
    lanes = [steps for rollouts in groups.values() for steps in rollouts]

    async def agents(producer: StepProducer) -> tuple[list[int], int]:
        threads = threading.active_count()

        async def agent(steps: list[Step]) -> int:
            acknowledged = 0
            for step in steps:  # one call per LLM call, each awaited before the next turn
                acknowledged += await producer.submit_steps_async([step], channel="train")
            if not steps[-1].is_last:
                await producer.complete_trajectory_async(steps[0].trajectory_uid, steps[0].prompt_uid,
                                                         reward=2.5, channel="train")
            return acknowledged

        counts = await asyncio.gather(*(agent(steps) for steps in lanes))
        return counts, threading.active_count() - threads

    with StepProducer(bootstrap_servers, prefix=prefix) as producer, \
            BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:
        producer.provision("train")
        start_worker(n_rollouts=2)
        counts, new_threads = asyncio.run(agents(producer))
        assert counts == [5, 5, 5, 5]
        assert new_threads <= 1, "at most the producer's one poll thread, not a thread per call"
        assert sum(end_offsets(bootstrap_servers, steps_topic("train", prefix))) == 20 + 2  # acknowledged: there
        got = {g.prompt_uid: g for g in fetch_groups(trainer, 2, timeout=120)}
    assert [tokens(s) for s in got["mt0"].steps] == [tokens(s) for t in groups["mt0"] for s in t]
    mt1 = got["mt1"].steps
    assert [(s.step_index, s.prompt_ids) for s in mt1] == [(s.step_index, s.prompt_ids) for t in groups["mt1"]
                                                          for s in t], "whole prompts, from deltas"
    assert [(s.reward, s.is_last) for s in mt1 if s.step_index == 4] == [(2.5, True), (2.5, True)]


def test_one_step_calls_from_threads_and_coroutines_at_once_are_each_acknowledged(bootstrap_servers, prefix):
    groups = multi_turn_groups(time.time() - 100)
    lanes = [steps for rollouts in groups.values() for steps in rollouts]

    def thread_lane(steps: list[Step]) -> int:
        return sum(producer.submit_steps([step], channel="train") for step in steps)

    async def coroutine_lane(steps: list[Step]) -> int:
        return sum([await producer.submit_steps_async([step], channel="train") for step in steps])

    async def coroutine_lanes() -> list[int]:
        return await asyncio.wait_for(asyncio.gather(*map(coroutine_lane, lanes[2:])), 60)

    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        with ThreadPoolExecutor(2) as pool:
            threaded = pool.map(thread_lane, lanes[:2])
            awaited = asyncio.run(coroutine_lanes())
            assert list(threaded) + awaited == [5, 5, 5, 5]
    events = decode_step_events(read_to_end(bootstrap_servers, steps_topic("train", prefix)))
    assert sorted(tokens(s) for s in events) == sorted(tokens(s) for steps in lanes for s in steps)


def test_async_calls_refuse_bad_input_and_send_nothing(bootstrap_servers, prefix):
    good = Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p")
    cases = [
        ([good, {"prompt_ids": [1], "response_ids": [2], "trajectory_uid": "t"}], "train", None, "^prompt_uid: "),
        ([good, {**good.__dict__, "step_index": -1}], "train", None, "^step_index: "),
        ([good, {**good.__dict__, "response_ids": [1.5]}], "train", None, r"^response_ids\[0\]: "),
        ([good], "no such channel", None, "^channel: "),
        ([good], "train", 0, "^n_rollouts: "),
        ([Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p", channel="val")],
         "train", None, "^channel: "),
    ]

    async def refused(producer: StepProducer) -> None:
        for steps, channel, n_rollouts, match in cases:
            with pytest.raises(ValueError, match=match):
                await producer.submit_steps_async(steps, channel=channel, n_rollouts=n_rollouts)
        with pytest.raises(ValueError, match="^channel: "):
            await producer.complete_trajectory_async("t", "p", channel="UPPER")
        with pytest.raises(ValueError, match="^reward: "):
            await producer.complete_trajectory_async("t", "p", reward=float("nan"))
        assert await producer.submit_steps_async([], channel="train") == 0

    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        asyncio.run(refused(producer))
    assert sum(end_offsets(bootstrap_servers, steps_topic("train", prefix))) == 0


def test_an_async_call_provisions_a_new_channel_first(bootstrap_servers, prefix):
    step = Step(prompt_ids=[1], response_ids=[2], trajectory_uid="t", prompt_uid="p", is_last=True)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        assert asyncio.run(producer.submit_steps_async([step], channel="val")) == 1
        assert producer.is_provisioned("val")
    assert sum(end_offsets(bootstrap_servers, steps_topic("val", prefix))) == 1
