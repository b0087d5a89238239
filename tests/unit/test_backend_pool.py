"""The backend pool's choice of backend (round robin, stickiness, health), without any HTTP request; its
health checks and answers wired to ``gateway.engine.health``, against a small engine served in the test."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import httpx
import orjson
import pytest
from aiohttp import ClientSession, TCPConnector, web

from trajbus.gateway.engine.health import ProbeResult
from trajbus.gateway.engine.pool import BackendError, BackendPool, NoBackendAvailable

A, B, C = "http://a:1", "http://b:1", "http://c:1"


@pytest.fixture
def pool():
    pool = BackendPool([A, B, C])  # no client until started: sends nothing
    for backend in pool.backends.values():
        backend.liveness.probed(ProbeResult.PASSED, 0.0)
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
    pool.backends[B].liveness.probed(ProbeResult.FAILED, 1.0)
    assert picks(pool, 4) == [A, C, A, C]
    assert pool.pick(preferred=B).address != B


def test_a_refused_backend_is_taken_out_with_its_error(pool):
    pool._refused(pool.backends[A], httpx.ConnectError("refused"))
    assert not pool.backends[A].healthy and pool.backends[A].failures == 1
    assert pool.backends[A].last_error == "ConnectError: refused"
    assert A not in picks(pool, 4)


def test_a_backend_is_put_back_when_healthy_again(pool):
    pool.backends[A].liveness.probed(ProbeResult.FAILED, 1.0)
    assert A not in picks(pool, 3)
    pool.backends[A].liveness.probed(ProbeResult.PASSED, 2.0)
    assert A in picks(pool, 3)
    assert pool.pick(preferred=A).address == A


def test_excluded_backends_are_not_picked(pool):
    assert pool.pick(preferred=A, exclude={A}).address != A
    assert picks(pool, 2, exclude={A, B}) == [C, C]


def test_none_healthy_raises_naming_every_backend(pool):
    for backend in pool.backends.values():
        backend.liveness.probed(ProbeResult.FAILED, 1.0)
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
        pool.session, pool._probes = ClientSession(), ClientSession()  # as start() makes them, no probe loop
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
                     ("WARNING", "backend taken out address=ADDRESS error=its health check answered 503"),
                     ("WARNING", "backend back in address=ADDRESS")]


class Engine:
    """A vLLM-like engine in the test's event loop: ``/health`` after ``health_delay`` seconds,
    completions (streamed or not) answered ``status``."""

    def __init__(self) -> None:
        self.health_delay, self.status = 0.0, 200
        self.end_delay = 0.0
        """Seconds between a stream's ``[DONE]`` and its body's end (a later packet)."""
        self.peers: list[tuple] = []
        """Each completion request's client address: one per connection."""
        self.drop = 0
        """Completion requests whose connection is closed unanswered (a server timing out a kept-alive one)."""
        self.stale: set[tuple] = set()
        """Client addresses whose next request is closed unanswered: kept-alive connections the server timed out."""
        self.address = ""
        self.runner: web.AppRunner | None = None

    async def health(self, _request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay)
        return web.Response(text="ok")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if self.status != 200:
            return web.json_response({"error": "engine fault"}, status=self.status)
        peer = request.transport.get_extra_info("peername")
        if self.drop or peer in self.stale:
            self.drop = max(0, self.drop - 1)
            self.stale.discard(peer)
            request.transport.close()
            return web.Response()  # never sent: the connection is gone
        self.peers.append(peer)
        choice = {"index": 0, "text": "4", "finish_reason": "stop",
                  "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5]}}
        if not (await request.json()).get("stream"):
            return web.json_response({"choices": [choice]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\ndata: [DONE]\n\n")
        await asyncio.sleep(self.end_delay)
        await response.write_eof()
        return response

    @contextlib.asynccontextmanager
    async def serving(self, **pool_options: Any) -> AsyncIterator[BackendPool]:
        """This engine served, and a pool over it with a client (no health loop: the test probes)."""
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.address = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        pool = BackendPool([self.address], **pool_options)
        pool.session, pool._probes = ClientSession(), ClientSession()  # as start() makes them, no probe loop
        pool._fresh = ClientSession(connector=TCPConnector(force_close=True))
        try:
            yield pool
        finally:
            await pool.close()
            await self.runner.cleanup()


def test_a_backend_answering_its_calls_stays_in_while_its_health_check_is_slow():
    """The pool wired to the rule: an answered call (plain or streamed to its end) is a sign of life, a
    health check with no answer in time keeps such a backend in; answered errors are no sign of life,
    so the same slow check takes out a backend that only failed since (the window: faked by ageing)."""

    async def run() -> None:
        engine = Engine()
        async with engine.serving(health_timeout=0.05) as pool:
            backend = pool.backends[engine.address]
            assert await pool.check(backend) and pool.ready
            engine.health_delay = 0.5  # busy: its /health answers after the pool stops waiting
            backend.liveness.alive_at -= 1000  # its passing check was long ago
            address, [choice] = await pool.complete([1, 2], {"max_tokens": 4})
            assert address == engine.address and choice.token_ids == [7]
            assert await pool.check(backend) and pool.ready and pool.pick() is backend
            assert backend.slow_health_checks == 1 and backend.healthy

            backend.liveness.alive_at -= 1000
            _, stream = await pool.stream([1, 2], {"max_tokens": 4})
            assert [piece.token_ids async for piece in stream] == [[7]]
            assert await pool.check(backend) and backend.slow_health_checks == 2

            backend.liveness.alive_at -= 1000
            engine.status = 500
            with pytest.raises(BackendError):
                await pool.complete([1, 2], {"max_tokens": 4})
            assert backend.failures == 1 and backend.healthy  # counted; only the check decides
            assert not await pool.check(backend) and not pool.ready
            assert backend.last_error == "its health check got no answer within 0.05 s"

            engine.health_delay, engine.status = 0.0, 200
            assert await pool.check(backend) and pool.ready

    asyncio.run(run())


def test_a_backend_whose_process_is_gone_is_out_at_once_despite_its_answers():
    async def run() -> None:
        engine = Engine()
        async with engine.serving(health_timeout=0.05) as pool:
            backend = pool.backends[engine.address]
            assert await pool.check(backend)
            await pool.complete([1], {})
            await engine.runner.cleanup()  # the process is gone
            assert not await pool.check(backend)  # refused, though it answered just now
            assert not pool.ready and backend.slow_health_checks == 0
            assert backend.last_error.startswith("ClientConnectorError")
            with pytest.raises(NoBackendAvailable):
                pool.pick()

    asyncio.run(run())


def test_streams_read_to_done_keep_one_connection_even_when_the_body_ends_later():
    """A stream's body ends (its chunked terminator) after ``[DONE]``, here in a later packet: the answer is
    whole at ``[DONE]``, and its connection goes back to the pool for the next call instead of being closed
    (every call would pay a new connection on the gateway and on the engine)."""

    async def run() -> None:
        engine = Engine()
        engine.end_delay = 0.05
        async with engine.serving() as pool:
            await pool.check(pool.backends[engine.address])
            for _ in range(3):
                _, stream = await pool.stream([1, 2], {"max_tokens": 4})
                assert [piece.token_ids async for piece in stream] == [[7]]
        assert len(engine.peers) == 3 and len(set(engine.peers)) == 1

    asyncio.run(run())


def test_a_connection_the_engine_closes_unanswered_is_retried_once_on_a_new_one_and_the_engine_stays_in():
    """Under load an engine's server times out a kept-alive connection as the next request goes out on it: the
    call is sent again on a connection of its own (not another pooled one, which may be timed out too), and the
    engine is not taken out. A second loss in a row fails that call alone while the engine answered lately (one
    busy engine taken out failed every call in flight until its next probe); with no answer for a window, out."""
    async def run() -> None:
        engine = Engine()
        async with engine.serving() as pool:
            backend = pool.backends[engine.address]
            assert await pool.check(backend)
            await asyncio.gather(pool.complete([1], {}), pool.complete([1], {}))  # two connections kept alive
            engine.stale = set(engine.peers)  # both timed out by the engine's server
            _, [answer] = await pool.complete([1], {})
            assert answer.token_ids == [7] and backend.liveness.in_service and backend.failures == 0
            assert engine.peers[-1] not in engine.peers[:2]  # the retry's own connection, not the other pooled one
            engine.drop = 2
            with pytest.raises(NoBackendAvailable):
                await pool.complete([1], {})
            assert backend.liveness.in_service and backend.failures == 1 and engine.drop == 0
            _, [answer] = await pool.complete([1], {})  # the next call is served
            assert answer.token_ids == [7]
            backend.liveness.alive_at -= 1000  # no answer for a window: a lost connection now takes it out
            engine.drop = 2
            with pytest.raises(NoBackendAvailable):
                await pool.complete([1], {})
            assert not backend.liveness.in_service and engine.drop == 0

    asyncio.run(run())
