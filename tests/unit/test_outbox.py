"""The outbox's promise without a broker: a group and a ledger outcome are answered only once acknowledged."""

from __future__ import annotations

import asyncio
from typing import Any

from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire import ledger
from trajbus.streams.worker.outbox import Outbox
from trajbus.streams.worker.settings import ChannelSettings, WorkerSettings
from trajbus.streams.worker.stats import WorkerMetrics


class Acknowledged:
    partition, offset = 0, 7


class HeldTopic:
    """A Faust topic whose sends are acknowledged only when the test says so."""

    def __init__(self, acks: list[asyncio.Future]) -> None:
        self.acks = acks

    async def send(self, **kwargs: Any) -> asyncio.Future:
        ack = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        return ack


class HeldApp:
    def __init__(self) -> None:
        self.acks: list[asyncio.Future] = []

    def topic(self, name: str, **kwargs: Any) -> HeldTopic:
        return HeldTopic(self.acks)


def test_the_outbox_returns_a_group_and_an_outcome_only_once_acknowledged():
    async def main() -> None:
        app = HeldApp()
        settings = WorkerSettings(topics=TopicSettings(prefix="p"), channels=("train",), default=ChannelSettings())
        outbox = Outbox(app, settings, WorkerMetrics())
        group = asyncio.create_task(outbox.group("train", b"g", b"v", [], 0.0))
        outcome = asyncio.create_task(outbox.outcome("train", ledger.Outcome.of("g", "emitted", (0, 7))))
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(app.acks) == 2 and not group.done() and not outcome.done()
        for ack in app.acks:
            ack.set_result(Acknowledged())
        assert await group == (0, 7)
        await outcome

    asyncio.run(main())
