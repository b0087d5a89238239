"""The weight-update gate's rules, on one event loop: held calls, cuts, resumes, the pause limit."""

from __future__ import annotations

import asyncio

import pytest

from trajbus.gateway.engine.updates import UpdateGate
from trajbus.gateway.errors import GatewayError
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.state.served_version import ServedVersion


class Reader:
    """A generation in flight: ``cut`` cancels its reader task."""

    def __init__(self, cuttable: bool = True) -> None:
        self.task = asyncio.create_task(asyncio.sleep(60))
        self.cuts = 0
        self.cuttable = cuttable

    def cut(self) -> list[asyncio.Task] | None:
        self.cuts += 1
        if self.task.done():
            return None  # cut already: waits for the resume
        self.task.cancel()
        return [self.task]


async def until(condition, what: str, timeout: float = 5.0) -> None:
    """Let the loop run until ``condition`` holds (the pause's own steps happen between two yields)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0)


class Published:
    """The policy topic as followed: the version the engines serve, as the trainer published it."""

    def __init__(self, serving: int | None) -> None:
        self.version = serving

    def serving(self, channel: str) -> int | None:
        return self.version

    def current(self, channel: str) -> int | None:
        return self.version

    def versions(self) -> dict[str, int]:
        return {} if self.version is None else {"serving.global": self.version}

    def close(self) -> None:
        pass


def gate(max_pause: float = 30.0, serving: int | None = None) -> UpdateGate:
    served = ServedVersion("trajbus", "train", Published(serving))
    return UpdateGate(max_pause, GatewayMetrics("test", "http://test"), served)


def test_a_pause_cuts_what_runs_holds_new_calls_and_a_resume_releases_them():
    async def scenario() -> None:
        updates = gate(serving=4)
        running = Reader()
        updates.enter(running)
        paused = await updates.pause()
        assert paused["cut"] == 1 and paused["serving"] == 4 and running.task.cancelled()
        again = await updates.pause()  # idempotent: still paused, nothing left reading to cut
        assert again["paused"] is True and again["cut"] == 0 and again["in_flight"] == 1
        with pytest.raises(GatewayError) as refused:
            await updates.hold(0.0)
        assert refused.value.status == 429 and refused.value.code == "paused_for_update"
        held = asyncio.create_task(updates.hold(10.0))
        waiting = asyncio.create_task(updates.resumed())
        await asyncio.sleep(0)
        assert not held.done() and not waiting.done()
        assert updates.resume(5)["paused"] is False
        await held
        assert await waiting == 5 and not updates.paused
        assert updates.resume(5)["paused_seconds"] == 0.0  # idempotent
        assert updates.served.serving() == 5  # the newer of the resume's and the topic's
        with pytest.raises(GatewayError) as older:
            updates.resume(4)
        assert older.value.status == 409

    asyncio.run(scenario())


def test_an_older_version_than_the_one_served_is_refused_before_any_resume():
    with pytest.raises(GatewayError, match="older than the version served, 7"):
        gate(serving=7).resume(6)


def test_past_the_pause_limit_held_and_cut_calls_end_with_a_retryable_503():
    async def scenario() -> None:
        updates = gate(max_pause=0.2)
        await updates.pause()
        held = asyncio.create_task(updates.hold(30.0))
        with pytest.raises(GatewayError) as cut:
            await updates.resumed()
        with pytest.raises(GatewayError) as late:
            await held
        for error in (cut.value, late.value):
            assert error.status == 503 and error.code == "paused_too_long" and error.retry_after == 1
        with pytest.raises(GatewayError, match="paused_too_long|more than"):
            await updates.hold(5.0)  # a call arriving past the limit is not held at all

    asyncio.run(scenario())


def test_drain_waits_for_the_generations_in_flight_instead_of_cutting_them():
    async def scenario() -> None:
        updates = gate()
        running = Reader()
        updates.enter(running)
        pausing = asyncio.create_task(updates.pause(drain=True))
        await until(lambda: updates.paused, "the pause to begin")  # it then waits for the generation to leave
        assert not pausing.done() and running.cuts == 0
        updates.leave(running)
        assert (await pausing)["cut"] == 0
        running.task.cancel()

    asyncio.run(scenario())


def test_a_generation_read_as_one_answer_is_waited_for_not_cut():
    async def scenario() -> None:
        updates = gate()
        streamed, whole = Reader(), Reader(cuttable=False)
        updates.enter(streamed)
        updates.enter(whole)
        pausing = asyncio.create_task(updates.pause())
        await until(streamed.task.cancelled, "the streamed generation to be cut")
        assert not pausing.done() and whole.cuts == 0
        updates.leave(whole)
        assert (await pausing)["cut"] == 1
        whole.task.cancel()

    asyncio.run(scenario())
