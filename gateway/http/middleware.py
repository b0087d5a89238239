"""The gateway's ASGI middleware, plain ASGI (no per-request task or stream hand-off):

- ``BodySizeLimit``: 413 for bodies over the cap, declared or streamed;
- ``CallLimit``: beyond ``--max-concurrent-calls`` engine calls, 503 with ``Retry-After`` at once, so
  an overloaded gateway answers early instead of queueing every caller into its timeout;
- ``Drain``: while the gateway shuts down (SIGTERM), new calls are 503 with ``Retry-After`` and calls cut
  by the end of the drain too, never a plain-text error;
- ``RequestObserver``: request counts and latency per route, and a log line for every error answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trajbus.gateway.errors import GatewayError, unavailable
from trajbus.gateway.http.quiet import QuietUpkeep
from trajbus.gateway.metrics import GatewayMetrics

log = logging.getLogger("trajbus.gateway")

ENGINE_CALLS = ("/chat/completions", "/generate", "/v1/messages")
"""Paths (by their end) whose requests hold an engine call: what ``CallLimit`` counts."""
SHED_RETRY_SECONDS = 1


async def _answer(error: GatewayError, send: Send) -> None:
    await error.response()({"type": "http"}, None, send)  # type: ignore[arg-type]


class BodySizeLimit:
    """413 for request bodies over the cap, declared (Content-Length) or streamed (chunked).

    A chunked body is read here first, up to the cap, then handed on: the
    framework never sees a body it would have to fail on mid-parse.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._reject(send)
            return await self.app(scope, receive, send)
        messages: list[Message] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                return await self._reject(send)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        await _answer(GatewayError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large"),
                      send)


class CallLimit:
    """At most ``limit`` engine calls at once; the next is shed with 503 and ``Retry-After``. ``quiet`` is told when
    the calls in flight go from none to some and back (``gateway.http.quiet``)."""

    def __init__(self, app: ASGIApp, limit: int, metrics: GatewayMetrics,
                 quiet: QuietUpkeep | None = None) -> None:
        self.app, self.limit, self.metrics, self.quiet = app, limit, metrics, quiet
        self.in_flight = 0
        metrics.calls_in_flight.set_function(lambda: self.in_flight)  # read when scraped: nothing per call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith(ENGINE_CALLS):
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            self.metrics.shed.labels(scope["path"].rsplit("/v1/", 1)[-1]).inc()  # chat/completions, messages
            return await _answer(unavailable(f"the gateway serves {self.limit} engine calls at once "
                                             f"(--max-concurrent-calls); retry shortly", code="overloaded",
                                             retry_after=SHED_RETRY_SECONDS), send)
        self.in_flight += 1
        if self.in_flight == 1 and self.quiet is not None:
            self.quiet.busy()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if not self.in_flight and self.quiet is not None:
                self.quiet.quiet()


class Drain:
    """While the gateway drains (``GatewayService.drain``, on SIGTERM), new work is answered 503 with
    ``Retry-After`` at once; reads (GET, HEAD: ``/ready`` says why) and the admin plane (``/admin/``) are still
    served. Every answer given while draining closes its connection, so a keep-alive client reconnects (to the
    restarted instance, or through the load balancer to another) instead of reusing a connection about to close.
    A call still in flight at the end of the drain is cancelled by uvicorn (``--drain-timeout``); it is answered
    503 with ``Retry-After`` here rather than with uvicorn's plain-text 500, unless its answer had begun (a stream
    under way can only be cut)."""

    def __init__(self, app: ASGIApp, draining: Callable[[], bool]) -> None:
        self.app, self.draining = app, draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def answer(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.draining():
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        if self.draining() and scope["method"] not in ("GET", "HEAD") and not scope["path"].startswith("/admin/"):
            return await _answer(unavailable("the gateway is shutting down and takes no new calls; retry after "
                                             "Retry-After (a trajectory continues where it was)",
                                             code="shutting_down"), answer)
        try:
            await self.app(scope, receive, answer)
        except asyncio.CancelledError:
            if started or not self.draining():
                raise
            # Cancelled for good by uvicorn's shutdown: answer, then end the task (nothing awaits it).
            await _answer(unavailable("the gateway shut down before this call was answered (--drain-timeout); "
                                      "retry after Retry-After", code="shutting_down"), answer)


class RequestObserver:
    """Counts and times every request by route template and status; logs the errors (not ``/ready``'s)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        status = 500

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            elapsed = time.monotonic() - started
            self.metrics.requests_of[route, str(status)].inc()
            self.metrics.latency_of[route].observe(elapsed)
            if status >= 400 and route != "/ready":  # 503 while starting is expected
                log.info("request method=%s route=%s status=%d ms=%.1f", scope["method"], route, status,
                         1000 * elapsed)
