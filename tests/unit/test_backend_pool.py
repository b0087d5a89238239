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
