"""The gateway's plain-ASGI middleware: load shedding beyond the engine-call limit (and when the instance goes
quiet), request metrics."""

from __future__ import annotations

import asyncio

import httpx

from trajbus.gateway.http.middleware import CallLimit, RequestObserver
from trajbus.gateway.metrics import GatewayMetrics


def test_engine_calls_beyond_the_limit_are_shed_at_once_with_503_and_retry_after():
    metrics = GatewayMetrics("test", "http://test")
    release = asyncio.Event()

    async def engine_bound(scope, receive, send):  # a chat call that holds its engine call until released
        if scope["path"].endswith("/chat/completions"):
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    transitions: list[str] = []

    class Quiet:  # what gateway.http.quiet is told
        def busy(self) -> None:
            transitions.append("busy")

        def quiet(self) -> None:
            transitions.append("quiet")

    app = RequestObserver(CallLimit(engine_bound, limit=2, metrics=metrics, quiet=Quiet()), metrics)

    async def scenario() -> tuple[list[int], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            held = [asyncio.create_task(client.post("/t/p/v1/chat/completions")) for _ in range(2)]
            async def both_held() -> None:
                while app.app.in_flight < 2:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(both_held(), 10)
            shed = await client.post("/t/p/v1/chat/completions")
            other_route = await client.get("/statistics")  # not an engine call: never shed
            release.set()
            return [r.status_code for r in await asyncio.gather(*held)], shed, other_route

    held, shed, other_route = asyncio.run(scenario())
    assert held == [200, 200] and other_route.status_code == 200
    assert transitions == ["busy", "quiet"], "two calls in flight together: busy once, quiet once both ended"
    assert shed.status_code == 503 and shed.headers["retry-after"] == "1"
    assert shed.json()["error"]["code"] == "overloaded" and shed.json()["error"]["type"] == "service_unavailable"
    samples = {(s.name, tuple(s.labels.values())): s.value for m in metrics.registry.collect() for s in m.samples}
    assert samples[("trajbus_gateway_shed_total", ("chat/completions",))] == 1.0
    assert samples[("trajbus_gateway_requests_total", ("unmatched", "503"))] == 1.0
    assert samples[("trajbus_gateway_requests_total", ("unmatched", "200"))] == 3.0  # one child, bound once, counts all
    assert samples[("trajbus_gateway_request_seconds_count", ("unmatched",))] == 4.0
