"""The inference backends behind the gateway: vLLM-compatible servers, round robin.

Calls of one trajectory stay on one backend while it is healthy (its prefix
cache holds the conversation so far). A backend that refuses a connection, or
fails its health check, is taken out; the health loop puts it back once
``GET /health`` answers again. A health check that only gets no answer in time
takes out no backend that answered lately (``gateway.engine.health``: a busy engine
is not a dead one). A request is retried on another backend when
no answer came from the first: the connection could not be made, or it broke
before any response (a server closing its idle keep-alive connections as it
shuts down does this to a request sent at that moment). A kept-alive connection
lost so is retried once on the same backend, on a connection of its own: at
thousands of calls in flight the gateway reads answers late, so more than one
pooled connection may be one the engine has timed out. A generation has no
effect outside its answer (the Step is published from the answer the gateway
got), so the only cost of such a retry is engine time; a backend that answered,
or broke off mid-answer, is an error, never repeated.

The gateway asks for what token-exact capture needs: a token-id prompt and
per-token ``logprobs`` with ``return_tokens_as_token_ids``, so the sampled ids
come with their log-probs. Not ``return_token_ids``: it makes vLLM echo the
whole prompt's ids in every answer, which the gateway would parse only to drop
(8k ids of JSON per call on a long conversation). An answer that carries
``token_ids`` anyway is read from them. Answers are read in ``gateway.engine.answers``.

The engine client is aiohttp (its per-request overhead at hundreds of concurrent
calls is a fraction of httpx's), and request and answer bodies are orjson: the
8k-id prompt of a long conversation is encoded in C.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from trajbus.gateway.engine.answers import BackendError, Completion, EngineStream, whole_answer
from trajbus.gateway.engine.health import ALIVE_WINDOW, Change, Liveness, ProbeResult
from trajbus.gateway.prompts.token_ids import AnyIds, as_json

log = logging.getLogger("trajbus.gateway")

NO_ANSWER = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ConnectionTimeoutError)
"""Errors before any response header (refused, reset, a keep-alive connection the server closed, no
connection in time): nothing came back, so another backend may try."""


def lost_connection(exc: Exception) -> bool:
    """An open connection the engine closed before answering (not a refused one): most often a kept-alive one
    its server timed out as the request went out, which an engine behind on its event loop does under load."""
    return isinstance(exc, (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)) and \
        not isinstance(exc, aiohttp.ClientConnectorError)


class NoBackendAvailable(RuntimeError):
    """Every backend is out (or was tried and refused the connection)."""


@dataclass
class Backend:
    address: str
    liveness: Liveness = field(default_factory=Liveness)
    """Whether it is in service, from its probes and its answers."""
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    last_error: str | None = None
    checked_at: float = 0.0
    slow_health_checks: int = 0
    """Health checks that got no answer in time."""

    @property
    def healthy(self) -> bool:
        """In service: calls may be sent to it."""
        return self.liveness.in_service

    def describe(self) -> dict[str, Any]:
        return {"address": self.address, "healthy": self.healthy, "in_flight": self.in_flight,
                "requests": self.requests, "failures": self.failures, "last_error": self.last_error,
                "slow_health_checks": self.slow_health_checks}


def request_body(prompt_ids: AnyIds, sampling: dict[str, Any], model: str | None, stream: bool,
                 stream_interval: int = 1) -> dict[str, Any]:
    """The vLLM completions request of one call (``stream_interval``: tokens per streamed event, sent above 1);
    written with ``orjson.OPT_SERIALIZE_NUMPY`` (a token array's ids go as a zero-copy view)."""
    body = {"prompt": as_json(prompt_ids), "logprobs": 0, "return_tokens_as_token_ids": True,
            "skip_special_tokens": True, "stream": stream, **{k: v for k, v in sampling.items() if v is not None}}
    if model:
        body["model"] = model
    if stream and stream_interval > 1:
        body["stream_interval"] = stream_interval
    return body


HEALTH_TIMEOUT = 5.0
"""Seconds a health probe waits for its answer (a slower one is judged by ``gateway.engine.health``)."""
JSON_HEADERS = {"Content-Type": "application/json"}
KEEPALIVE_SECONDS = 2.0
"""Idle connections are dropped before servers close them (uvicorn, vLLM's server: after 5 s), so a
request is never sent on a connection the server is closing."""
CONNECT_SECONDS = 30.0
"""Seconds a new connection to an engine may take to open (the TCP connect only: see ``BackendPool.start``). Long
enough for a burst: when thousands of agents call at once, the event loop reaches a connection that opened at
once only after the other calls' work, seconds later (at 5 s, 4,096 agents starting together on one instance
got 503 no_backend from a healthy engine). An engine that is down refuses at once, and its health check takes
one that does not answer out of service."""
ENGINE_CONNECTIONS = 1024
"""Connections one instance opens to one engine at most (``--engine-connections``): an engine's listening queue
holds a few thousand new connections (vLLM's uvicorn: 2,048), and thousands opened at once overflow it: they are
reset or time out as if the engine were down. Calls beyond wait in the gateway for one of its connections."""


class BackendPool:
    def __init__(self, addresses: list[str], timeout: float = 600.0, health_interval: float = 2.0,
                 health_timeout: float = HEALTH_TIMEOUT, alive_window: float = ALIVE_WINDOW,
                 read_interval: float = 0.0, connections_per_engine: int = ENGINE_CONNECTIONS) -> None:
        window = max(alive_window, 2 * health_interval + health_timeout)  # one slow probe after a pass: kept
        self.backends = {address: Backend(address, Liveness(window)) for address in addresses}
        self.health_timeout = aiohttp.ClientTimeout(total=health_timeout)
        self._order = list(self.backends)
        self._next = 0
        self.health_interval = health_interval
        self.model: str | None = None
        self._sticky: dict[str, str] = {}  # trajectory uid -> backend, for white-box callers (bounded)
        self.timeout = timeout
        self.read_interval = read_interval
        """Seconds a stream waits after a read before the next (``EngineStream``)."""
        self.connections_per_engine = connections_per_engine
        self.session: aiohttp.ClientSession | None = None
        """The engine calls' client, made by ``start`` on the event loop it serves."""
        self._probes: aiohttp.ClientSession | None = None
        """The health probes' own client: a probe never waits behind the calls for a connection."""
        self._fresh: aiohttp.ClientSession | None = None
        """A call's retry after a lost connection: a new connection each time (closed after), never a pooled one."""
        self._health_task: asyncio.Task | None = None

    # -- health -----------------------------------------------------------------
    async def check(self, backend: Backend) -> bool:
        """One health probe, judged beside the backend's recent answers; whether it is in service."""
        try:
            async with self._probes.get(f"{backend.address}/health", timeout=self.health_timeout) as response:
                probe = ProbeResult.PASSED if response.status == 200 else ProbeResult.FAILED
                if probe is ProbeResult.FAILED:
                    backend.last_error = f"its health check answered {response.status}"
            if probe is ProbeResult.PASSED and self.model is None:
                self.model = await self._model_name(backend)
        except asyncio.TimeoutError:  # before ClientError: aiohttp's timeouts are both
            probe = ProbeResult.SLOW
            backend.slow_health_checks += 1
            backend.last_error = f"its health check got no answer within {self.health_timeout.total:g} s"
        except aiohttp.ClientError as exc:
            probe, backend.last_error = ProbeResult.FAILED, f"{type(exc).__name__}: {exc}"
        now = time.monotonic()
        self._changed(backend, backend.liveness.probed(probe, now), now)
        backend.checked_at = time.time()
        return backend.healthy

    def _changed(self, backend: Backend, change: Change | None, now: float) -> None:
        """Log a change of service, once."""
        if change is Change.READY:  # a backend first seen healthy is not "back"
            log.info("backend ready address=%s model=%s", backend.address, self.model)
        elif change is Change.BACK_IN:
            log.warning("backend back in address=%s", backend.address)
        elif change is Change.TAKEN_OUT:
            log.warning("backend taken out address=%s error=%s", backend.address, backend.last_error)
        elif change is Change.KEPT_IN:
            log.warning("backend kept in service: its health check got no answer in time, but it answered "
                        "%.1f s ago address=%s", backend.liveness.answered_ago(now), backend.address)

    async def _model_name(self, backend: Backend) -> str | None:
        try:
            async with self._probes.get(f"{backend.address}/v1/models", timeout=self.health_timeout) as response:
                return orjson.loads(await response.read())["data"][0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return None

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends.values()))

    def start(self) -> None:
        """On the event loop: open the client and check the backends from now on.

        Each engine gets at most ``connections_per_engine`` connections; a call beyond waits for one, and the wait
        is not timed: aiohttp's ``connect`` timeout would count it, and calls failed as if the engine were down
        (at 2,048 calls in flight). Only the socket's connect is timed (``sock_connect``)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_SECONDS, sock_read=self.timeout)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=self.connections_per_engine,
                                           keepalive_timeout=KEEPALIVE_SECONDS), timeout=timeout)
        self._fresh = aiohttp.ClientSession(  # retries: rare, each on a connection opened for it
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=self.connections_per_engine, force_close=True),
            timeout=timeout)
        self._probes = aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_SECONDS))

        async def loop() -> None:
            while True:
                await self.check_all()
                await asyncio.sleep(self.health_interval)

        self._health_task = asyncio.create_task(loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for session in (self.session, self._fresh, self._probes):
            if session is not None:
                await session.close()

    @property
    def ready(self) -> bool:
        return any(b.healthy for b in self.backends.values())

    # -- choosing ---------------------------------------------------------------
    def pick(self, preferred: str | None = None, exclude: set[str] = frozenset()) -> Backend:
        """The trajectory's backend while healthy, else the next healthy one in round robin."""
        if preferred in self.backends and self.backends[preferred].liveness.in_service and preferred not in exclude:
            return self.backends[preferred]
        for _ in range(len(self._order)):
            backend = self.backends[self._order[self._next % len(self._order)]]
            self._next += 1
            if backend.liveness.in_service and backend.address not in exclude:
                return backend
        raise NoBackendAvailable("no inference backend is available: "
                                 + "; ".join(f"{b.address}: {b.last_error or 'unhealthy'}"
                                             for b in self.backends.values()))

    def remembered(self, trajectory_uid: str | None) -> str | None:
        """The backend a white-box trajectory last used (its own state lives with the agent)."""
        return self._sticky.get(trajectory_uid) if trajectory_uid else None

    def remember(self, trajectory_uid: str | None, backend: str, limit: int = 100_000) -> None:
        if trajectory_uid:
            self._sticky.pop(trajectory_uid, None)
            self._sticky[trajectory_uid] = backend
            if len(self._sticky) > limit:
                self._sticky.pop(next(iter(self._sticky)))

    def _refused(self, backend: Backend, exc: Exception) -> None:
        """No answer at all: refused, out at once; a new connection lost unanswered, out unless it answered
        lately (``Liveness.lost``)."""
        backend.failures += 1
        backend.last_error = f"{type(exc).__name__}: {exc}"
        now = time.monotonic()
        self._changed(backend, backend.liveness.lost(now) if lost_connection(exc) else backend.liveness.refused(),
                      now)

    async def _send(self, body: dict[str, Any], preferred: str | None
                    ) -> tuple[Backend, aiohttp.ClientResponse]:
        payload = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        tried: set[str] = set()
        reconnected = False  # one lost connection is retried on the same engine, on a new one
        session = self.session
        while True:
            backend = self.pick(preferred, exclude=tried)
            tried.add(backend.address)
            backend.in_flight += 1
            backend.requests += 1
            try:
                response = await session.post(f"{backend.address}/v1/completions", data=payload,
                                              headers=JSON_HEADERS)
            except NO_ANSWER as exc:  # nothing came back: safe to try another backend
                backend.in_flight -= 1
                if lost_connection(exc) and not reconnected:
                    reconnected, preferred, session = True, backend.address, self._fresh
                    tried.discard(backend.address)
                    continue
                self._refused(backend, exc)
                session = self.session
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                backend.in_flight -= 1
                backend.failures += 1
                raise BackendError(f"backend {backend.address} failed after the request was sent: "
                                   f"{type(exc).__name__}: {exc}") from exc
            if response.status != 200:
                backend.in_flight -= 1
                backend.failures += response.status >= 500  # the engine's fault, not the request's
                try:
                    detail = (await response.read()).decode(errors="replace")[:2000]
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    detail = f"(its body broke off: {type(exc).__name__})"
                response.release()
                raise BackendError(f"backend {backend.address} answered {response.status}: {detail}",
                                   status=400 if response.status == 400 else 502)
            backend.liveness.answered(time.monotonic())  # a sign of life, beside its probes (O(1): a store)
            return backend, response

    async def complete(self, prompt_ids: AnyIds, sampling: dict[str, Any],
                       preferred: str | None = None) -> tuple[str, list[Completion]]:
        """One non-streaming call; returns the backend used and its choices."""
        backend, response = await self._send(request_body(prompt_ids, sampling, self.model, False), preferred)
        try:
            choices = whole_answer(backend, await response.read(), sampling.get("n") or 1)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            backend.failures += 1
            raise BackendError(f"backend {backend.address} broke off: {type(exc).__name__}: {exc}") from exc
        finally:
            backend.in_flight -= 1
            response.release()
        return backend.address, choices

    async def stream(self, prompt_ids: AnyIds, sampling: dict[str, Any], preferred: str | None = None,
                     stream_interval: int = 1) -> tuple[str, EngineStream]:
        """A streaming call: connects (with the no-answer retry) before returning the stream."""
        backend, response = await self._send(request_body(prompt_ids, sampling, self.model, True, stream_interval),
                                              preferred)
        return backend.address, EngineStream(backend, response, sampling.get("n") or 1, self.read_interval)

    def describe(self) -> list[dict[str, Any]]:
        return [b.describe() for b in self.backends.values()]
