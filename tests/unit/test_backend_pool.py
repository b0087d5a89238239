"""The backend pool's choice of backend (round robin, stickiness, health), without any HTTP request."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from trajbus.gateway.backends import BackendPool, NoBackendAvailable

A, B, C = "http://a:1", "http://b:1", "http://c:1"


@pytest.fixture
def pool():
    pool = BackendPool([A, B, C])  # no client until started: sends nothing
    for backend in pool.backends.values():
        backend.healthy = True
    yield pool
    asyncio.run(pool.close())


def picks(pool, n, **kwargs):
    return [pool.pick(**kwargs).address for _ in range(n)]


def test_backends_start_unhealthy_until_checked():
    pool = BackendPool([A, B])
    try:
        assert not pool.ready
        with pytest.raises(NoBackendAvailable):
            pool.pick()
    finally:
        asyncio.run(pool.close())


def test_round_robin_over_healthy_backends(pool):
    assert picks(pool, 6) == [A, B, C, A, B, C]
    assert pool.ready


def test_a_trajectory_sticks_to_its_healthy_backend(pool):
    assert picks(pool, 3, preferred=B) == [B, B, B]
    assert picks(pool, 1) == [A]  # sticking does not advance the round robin


def test_unknown_preferred_backend_falls_back_to_round_robin(pool):
    assert picks(pool, 2, preferred="http://gone:1") == [A, B]


def test_an_unhealthy_backend_is_skipped_and_its_trajectory_moves(pool):
    pool.backends[B].healthy = False
    assert picks(pool, 4) == [A, C, A, C]
    assert pool.pick(preferred=B).address != B


def test_a_refused_backend_is_taken_out_with_its_error(pool):
    pool._refused(pool.backends[A], httpx.ConnectError("refused"))
    assert not pool.backends[A].healthy and pool.backends[A].failures == 1
    assert pool.backends[A].last_error == "ConnectError: refused"
    assert A not in picks(pool, 4)


def test_a_backend_is_put_back_when_healthy_again(pool):
    pool.backends[A].healthy = False
    assert A not in picks(pool, 3)
    pool.backends[A].healthy = True  # what a passing health check does
    assert A in picks(pool, 3)
    assert pool.pick(preferred=A).address == A


def test_excluded_backends_are_not_picked(pool):
    assert pool.pick(preferred=A, exclude={A}).address != A
    assert picks(pool, 2, exclude={A, B}) == [C, C]


def test_none_healthy_raises_naming_every_backend(pool):
    for backend in pool.backends.values():
        backend.healthy = False
    pool.backends[A].last_error = "ConnectError: refused"
    with pytest.raises(NoBackendAvailable) as caught:
        pool.pick(preferred=A)
    message = str(caught.value)
    assert f"{A}: ConnectError: refused" in message
    assert f"{B}: unhealthy" in message and f"{C}: unhealthy" in message
    assert not pool.ready


def test_all_healthy_but_excluded_raises(pool):
    with pytest.raises(NoBackendAvailable):
        pool.pick(exclude={A, B, C})


def test_white_box_trajectories_remember_their_backend_within_a_bound(pool):
    assert pool.remembered("t1") is None and pool.remembered(None) is None
    pool.remember("t1", A, limit=2)
    pool.remember("t2", B, limit=2)
    pool.remember("t1", C, limit=2)  # refreshed: now the newest
    pool.remember("t3", A, limit=2)  # over the bound: the oldest (t2) is forgotten
    assert [pool.remembered(t) for t in ("t1", "t2", "t3")] == [C, None, A]
    pool.remember(None, A)
    assert pool.remembered(None) is None


def test_a_backend_first_seen_healthy_is_ready_not_back_in(caplog):
    """Start-up is quiet: a backend up at start is announced once (INFO, with its model); only one that
    was healthy, then taken out, comes "back in" (a WARNING, as its going out was)."""
    from aiohttp import ClientSession, web

    async def run() -> list[tuple[str, str]]:
        health = {"status": 200}

        async def check(_request: web.Request) -> web.Response:
            return web.Response(status=health["status"])

        async def models(_request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "tiny"}]})

        app = web.Application()
        app.router.add_get("/health", check)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        address = "http://127.0.0.1:%d" % runner.addresses[0][1]
        pool = BackendPool([address])
        pool.session = ClientSession()
        backend = pool.backends[address]
        try:
            for status in (200, 200, 503, 200):
                health["status"] = status
                await pool.check(backend)
        finally:
            await pool.close()
            await runner.cleanup()
        return [(r.levelname, r.getMessage().replace(address, "ADDRESS")) for r in caplog.records
                if r.name == "trajbus.gateway"]

    with caplog.at_level("INFO", logger="trajbus.gateway"):
        lines = asyncio.run(run())
    assert lines == [("INFO", "backend ready address=ADDRESS model=tiny"),
                     ("WARNING", "backend taken out address=ADDRESS"),
                     ("WARNING", "backend back in address=ADDRESS")]
