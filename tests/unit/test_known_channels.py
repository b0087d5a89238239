"""The channels a gateway takes (``gateway.broker.channels``): those whose steps topic exists, or those declared;
the broker is asked again only on a miss, at most once per interval."""

from __future__ import annotations

import asyncio
import time

import pytest

from trajbus.gateway.broker.channels import KnownChannels
from trajbus.gateway.errors import GatewayError


class Topics:
    """The broker's topic names, noting when they were listed."""

    def __init__(self, *names: str) -> None:
        self.names, self.down = set(names), False
        self.times: list[float] = []

    def __call__(self) -> set[str]:
        self.times.append(time.monotonic())
        if self.down:
            raise RuntimeError("no broker answered")
        return set(self.names)


def refused(channels: KnownChannels, channel: str) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        asyncio.run(channels.check(channel))
    return caught.value


def test_a_channel_without_a_steps_topic_is_refused_naming_the_known_ones():
    topics = Topics("p.steps.train", "p.groups.train", "p.steps.val", "p.policy", "other.steps.trian", "p.steps.Bad")
    channels = KnownChannels("p", "train", refresh_seconds=0)
    channels.connect(topics)
    assert asyncio.run(channels.check("val")) == "val" and asyncio.run(channels.check(None)) == "train"
    error = refused(channels, "trian")
    assert (error.status, error.param, error.code) == (400, "channel", "unknown_channel")
    assert "known channels: train, val" in error.message and "p.steps.trian" in error.message
    assert "trajbus topics --create --channels trian" in error.message
    assert refused(channels, "No Way").param == "channel"  # not a channel name at all
    assert channels.known() == ["train", "val"]


def test_a_channel_created_after_the_start_is_taken_and_reads_are_an_interval_apart():
    topics = Topics("p.steps.train")
    channels = KnownChannels("p", "train", refresh_seconds=0.3)
    channels.connect(topics)
    for _ in range(3):
        asyncio.run(channels.check("train"))
    assert topics.times and len(topics.times) == 1, "known channels never ask the broker"
    topics.names.add("p.steps.val")  # created just after the gateway read its channels
    assert asyncio.run(channels.check("val")) == "val", "a channel that exists when a call names it is taken"
    assert refused(channels, "trian").code == "unknown_channel"
    assert asyncio.run(channels.check("val")) == "val"  # known now: no read
    assert len(topics.times) == 3
    assert all(later - earlier >= 0.3 for earlier, later in zip(topics.times, topics.times[1:])), topics.times


def test_concurrent_misses_share_one_read():
    topics = Topics("p.steps.train")
    channels = KnownChannels("p", "train", refresh_seconds=0.2)
    channels.connect(topics)
    topics.names.add("p.steps.val")

    async def many() -> list:
        checks = [channels.check(channel) for channel in ("val", "trian") * 10]
        return await asyncio.gather(*checks, return_exceptions=True)

    answers = asyncio.run(many())
    assert answers[::2] == ["val"] * 10
    assert {(a.status, a.code) for a in answers[1::2]} == {(400, "unknown_channel")}
    assert len(topics.times) == 2, "twenty misses, one read"


def test_declared_channels_never_ask_the_broker():
    topics = Topics("p.steps.train", "p.steps.val")
    channels = KnownChannels("p", "train", declared=["eval"], refresh_seconds=0)
    assert channels.provisioned_at_start == ["eval", "train"]  # the default channel is always served
    channels.connect(topics)
    assert asyncio.run(channels.check("eval")) == "eval" and asyncio.run(channels.check("train")) == "train"
    error = refused(channels, "val")
    assert error.code == "unknown_channel" and "--channels (known channels: eval, train)" in error.message
    assert topics.times == []


def test_while_the_broker_cannot_say_a_miss_is_a_503_not_a_400():
    channels = KnownChannels("p", "train", refresh_seconds=0)
    assert asyncio.run(channels.check(None)) == "train"  # the default channel: before Kafka is connected too
    assert refused(channels, "val").status == 503  # not connected yet
    topics = Topics("p.steps.train")
    channels.connect(topics)
    topics.down = True
    error = refused(channels, "val")
    assert (error.status, error.code, error.retry_after) == (503, "kafka_unavailable", 2)
    assert "no broker answered" in error.message
    topics.down = False
    topics.names.add("p.steps.val")
    assert asyncio.run(channels.check("val")) == "val"
