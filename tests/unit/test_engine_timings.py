"""The scripted engine's per-seed timing (``GET /timings``): what a benchmark subtracts to see the latency added
on the way to the engine."""

from __future__ import annotations

import asyncio

from trajbus.infra import scripted_engine
from trajbus.infra.scripted_engine import Timings


def test_a_seeded_call_is_timed_at_its_last_byte_and_only_the_latest_are_kept(monkeypatch):
    monkeypatch.setattr(scripted_engine, "TIMINGS_KEPT", 2)
    timings, sent = Timings(), []

    async def send(message: dict) -> None:
        sent.append(message)

    async def call(seed: int) -> dict[str, float]:
        timed = timings.timed(seed, send)
        await timed({"type": "http.response.start", "status": 200})
        await timed({"type": "http.response.body", "body": b"data: 1", "more_body": True})
        before_end = timings.served()
        await timed({"type": "http.response.body", "body": b"", "more_body": False})
        return before_end

    assert asyncio.run(call(7)) == {}  # not timed before its last byte
    assert list(timings.served()) == ["7"] and timings.served()["7"] >= 0 and len(sent) == 3
    asyncio.run(call(8))
    asyncio.run(call(9))
    assert list(timings.served()) == ["8", "9"]  # the oldest gave way
