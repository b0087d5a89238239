"""Thousands of calls in flight on one gateway instance (issue 47): an engine's call takes seconds, so a gateway in
front of it holds as many calls at once as it has agents. With the default settings, 2,048 calls in flight at the
same time (1,024 at the engine, ``--engine-connections``, the rest waiting for one of its connections) are all
answered: none shed (``--max-concurrent-calls``), none failed as if the engine were down (the wait for a
connection was once timed as the connect, and calls past 1,024 failed 503 no_backend)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import aiohttp
import httpx

from tests.helpers import wait_for

CALLS = 2048
IN_FLIGHT = re.compile(r"^trajbus_gateway_calls_in_flight (\S+)$", re.M)


def calls_in_flight(gateway: str) -> int:
    return int(float(IN_FLIGHT.search(httpx.get(f"{gateway}/metrics").text).group(1)))


async def open_trajectories(session: aiohttp.ClientSession, gateway: str) -> list[str]:
    """One trajectory per agent; their base URLs."""
    async def one(k: int) -> str:
        async with session.post(f"{gateway}/init_trajectory", json={"prompt_uid": f"p{k}", "n_rollouts": 1}) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["base_url"]

    return list(await asyncio.gather(*(one(k) for k in range(CALLS))))


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300))


async def call_all(gateway: str) -> list[tuple[int, str]]:
    """Every agent's call at once; (status, content or error) of each. The calls go on connections of their own:
    one the trajectories were opened on may sit idle past the server's keep-alive (5 s) while the last of 2,048
    are opened, and a request sent as the server closes it gets no answer (aiohttp's ServerDisconnectedError)."""
    async with session() as opening:
        base_urls = await open_trajectories(opening, gateway)
    async with session() as calling:

        async def call(base_url: str) -> tuple[int, str]:
            async with calling.post(f"{base_url}/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "What is 3 + 1?"}]}) as r:
                body = await r.json()
                return r.status, body["choices"][0]["message"]["content"] if r.status == 200 else str(body)

        return list(await asyncio.gather(*(call(url) for url in base_urls)))


def test_2048_calls_in_flight_at_once_are_all_answered_with_the_defaults(
        scripted_engine, start_gateway, tmp_path):
    gate = tmp_path / "open"
    engine, _ = scripted_engine([{"text": "4", "gate": str(gate)}], workers=CALLS)
    gateway, _ = start_gateway([engine])  # no --max-concurrent-calls: the default

    async def run() -> list[tuple[int, str]]:
        answers = asyncio.create_task(call_all(gateway))
        try:
            # every call is in the gateway (at the engine or waiting for a connection to it) before any is answered
            await asyncio.to_thread(wait_for, lambda: calls_in_flight(gateway) == CALLS or answers.done(), 180,
                                    f"{CALLS} calls in flight at the gateway at once", interval=0.5)
            assert not answers.done(), f"answered before the engine let any go: {Counter(answers.result())}"
        finally:
            gate.touch()
        return await answers

    answers = asyncio.run(run())
    assert Counter(answers) == {(200, "4"): CALLS}
    wait_for(lambda: calls_in_flight(gateway) == 0, 30, "every call to leave the gateway")
