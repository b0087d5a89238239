"""The inference backends behind the gateway: vLLM-compatible servers, round robin.

Calls of one trajectory stay on one backend while it is healthy (its prefix
cache holds the conversation so far). A backend that refuses a connection, or
fails its health check, is taken out; the health loop puts it back once
``GET /health`` answers again. A health check that only gets no answer in time
takes out no backend that answered lately (``backend_health``: a busy engine
is not a dead one). A request is retried on another backend when
no answer came from the first: the connection could not be made, or it broke
before any response (a server closing its idle keep-alive connections as it
shuts down does this to a request sent at that moment). A generation has no
effect outside its answer (the Step is published from the answer the gateway
got), so the only cost of such a retry is engine time; a backend that answered,
or broke off mid-answer, is an error, never repeated.

The gateway asks for what token-exact capture needs: a token-id prompt and
per-token ``logprobs`` with ``return_tokens_as_token_ids``, so the sampled ids
come with their log-probs. Not ``return_token_ids``: it makes vLLM echo the
whole prompt's ids in every answer, which the gateway would parse only to drop
(8k ids of JSON per call on a long conversation). An answer that carries
``token_ids`` anyway is read from them.

The engine client is aiohttp (its per-request overhead at hundreds of concurrent
calls is a fraction of httpx's), and request and answer bodies are orjson: the
8k-id prompt of a long conversation is encoded in C.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp
import orjson

from trajbus.gateway.backend_health import ALIVE_WINDOW, Change, Liveness, Probe

log = logging.getLogger("trajbus.gateway")

NO_ANSWER = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ConnectionTimeoutError)
"""Errors before any response header (refused, reset, a keep-alive connection the server closed, no
connection in time): nothing came back, so another backend may try."""


class NoBackendAvailable(RuntimeError):
    """Every backend is out (or was tried and refused the connection)."""


class BackendError(RuntimeError):
    """A backend answered with an error or broke off after the request reached it."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


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


@dataclass
class Completion:
    """One choice as the engine produced it, or (streaming) the next piece of one."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def _ids_of(choice: dict[str, Any]) -> list[int]:
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    if all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.split(":", 1)[1]) for t in tokens]
    raise BackendError("no token ids (needs vLLM's return_tokens_as_token_ids or return_token_ids)")


def _logprobs_of(choice: dict[str, Any]) -> list[float]:
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    if values is None:
        raise BackendError("no log-probabilities")
    return [float(v) for v in values]


def _check_every_choice_ended(backend: Backend, ended: set[int], choices: int, what: str) -> None:
    """An answer counts only once each of its choices has ended (a ``finish_reason``); else it is the engine's
    fault, so no truncated reply is answered 200 nor published for the trainer."""
    missing = sorted(set(range(choices)) - ended)
    if missing:
        backend.failures += 1
        raise BackendError(f"backend {backend.address} {what} without finishing choice(s) {missing}: "
                           "an unfinished reply")


def whole_answer(backend: Backend, raw: bytes, choices: int) -> list[Completion]:
    """A non-streamed completion's choices, by index; ``BackendError`` unless it is one, with ids and log-probs
    for each of its ``choices`` (an error body, a chat completion or a proxy's page is the engine's fault)."""
    try:
        data = orjson.loads(raw)
        if isinstance(data, dict) and "error" in data:
            raise BackendError(f"an error: {str(data['error'])[:2000]}")
        answer = [Completion(c["index"], _ids_of(c), _logprobs_of(c), c.get("text") or "",
                             c.get("finish_reason") or "stop") for c in data["choices"]]
    except (BackendError, ValueError, KeyError, TypeError) as exc:
        backend.failures += 1
        what = str(exc) if isinstance(exc, BackendError) else f"no completion ({type(exc).__name__}: {exc})"
        raise BackendError(f"backend {backend.address} answered {what[:2000]}") from exc
    _check_every_choice_ended(backend, {c.index for c in answer}, choices, "answered")
    return sorted(answer, key=lambda c: c.index)


def request_body(prompt_ids: list[int], sampling: dict[str, Any], model: str | None, stream: bool) -> dict[str, Any]:
    """The vLLM completions request of one call."""
    body = {"prompt": prompt_ids, "logprobs": 0, "return_tokens_as_token_ids": True,
            "skip_special_tokens": True, "stream": stream, **{k: v for k, v in sampling.items() if v is not None}}
    if model:
        body["model"] = model
    return body


HEALTH_TIMEOUT = 5.0
"""Seconds a health probe waits for its answer (a slower one is judged by ``backend_health``)."""
JSON_HEADERS = {"Content-Type": "application/json"}
KEEPALIVE_SECONDS = 2.0
"""Idle connections are dropped before servers close them (uvicorn, vLLM's server: after 5 s), so a
request is never sent on a connection the server is closing."""


class BackendPool:
    def __init__(self, addresses: list[str], timeout: float = 600.0, health_interval: float = 2.0,
                 health_timeout: float = HEALTH_TIMEOUT, alive_window: float = ALIVE_WINDOW) -> None:
        window = max(alive_window, 2 * health_interval + health_timeout)  # one slow probe after a pass: kept
        self.backends = {address: Backend(address, Liveness(window)) for address in addresses}
        self.health_timeout = aiohttp.ClientTimeout(total=health_timeout)
        self._order = list(self.backends)
        self._next = 0
        self.health_interval = health_interval
        self.model: str | None = None
        self._sticky: dict[str, str] = {}  # trajectory uid -> backend, for white-box callers (bounded)
        self.timeout = timeout
        self.session: aiohttp.ClientSession | None = None
        """Made by ``start``, on the event loop it serves."""
        self._health_task: asyncio.Task | None = None

    # -- health -----------------------------------------------------------------
    async def check(self, backend: Backend) -> bool:
        """One health probe, judged beside the backend's recent answers; whether it is in service."""
        try:
            async with self.session.get(f"{backend.address}/health", timeout=self.health_timeout) as response:
                probe = Probe.PASSED if response.status == 200 else Probe.FAILED
                if probe is Probe.FAILED:
                    backend.last_error = f"its health check answered {response.status}"
            if probe is Probe.PASSED and self.model is None:
                self.model = await self._model_name(backend)
        except asyncio.TimeoutError:  # before ClientError: aiohttp's timeouts are both
            probe = Probe.SLOW
            backend.slow_health_checks += 1
            backend.last_error = f"its health check got no answer within {self.health_timeout.total:g} s"
        except aiohttp.ClientError as exc:
            probe, backend.last_error = Probe.FAILED, f"{type(exc).__name__}: {exc}"
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
            async with self.session.get(f"{backend.address}/v1/models", timeout=self.health_timeout) as response:
                return orjson.loads(await response.read())["data"][0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return None

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends.values()))

    def start(self) -> None:
        """On the event loop: open the client and check the backends from now on."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=KEEPALIVE_SECONDS),
            timeout=aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=self.timeout))

        async def loop() -> None:
            while True:
                await self.check_all()
                await asyncio.sleep(self.health_interval)

        self._health_task = asyncio.create_task(loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.session is not None:
            await self.session.close()

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
        backend.failures += 1
        backend.last_error = f"{type(exc).__name__}: {exc}"
        self._changed(backend, backend.liveness.refused(), time.monotonic())

    async def _send(self, body: dict[str, Any], preferred: str | None
                    ) -> tuple[Backend, aiohttp.ClientResponse]:
        payload = orjson.dumps(body)
        tried: set[str] = set()
        while True:
            backend = self.pick(preferred, exclude=tried)
            tried.add(backend.address)
            backend.in_flight += 1
            backend.requests += 1
            try:
                response = await self.session.post(f"{backend.address}/v1/completions", data=payload,
                                                   headers=JSON_HEADERS)
            except NO_ANSWER as exc:  # nothing came back: safe to try another backend
                backend.in_flight -= 1
                self._refused(backend, exc)
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

    async def complete(self, prompt_ids: list[int], sampling: dict[str, Any],
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

    async def stream(self, prompt_ids: list[int], sampling: dict[str, Any],
                     preferred: str | None = None) -> tuple[str, "EngineStream"]:
        """A streaming call: connects (with the no-answer retry) before returning the stream."""
        backend, response = await self._send(request_body(prompt_ids, sampling, self.model, True), preferred)
        return backend.address, EngineStream(backend, response, sampling.get("n") or 1)

    def describe(self) -> list[dict[str, Any]]:
        return [b.describe() for b in self.backends.values()]


class EngineStream:
    """A streaming answer: its pieces in order, and ``close`` to cut it (the connection is closed, so
    the engine stops generating at its next token); a stream read to its end keeps its connection.

    Only a finished answer counts: a stream must end with ``[DONE]`` after a ``finish_reason`` for each
    choice. A body that ends otherwise (an engine that stopped early, a proxy that cut it) is a
    ``BackendError``: the agent gets a 502 and the trainer no truncated step. A JSON body instead of a
    stream (an engine that ignored ``stream``, a proxy that buffers) is read as the whole answer when it is
    a valid non-streamed completion: its ids and log-probs are exactly what was sampled, so capture stays
    token-exact and only the chance to cut it for a weight update is lost, which a finished answer no
    longer needs. A JSON body without them cannot be captured token-exactly and is refused (502).
    """

    def __init__(self, backend: Backend, response: aiohttp.ClientResponse, choices: int = 1) -> None:
        self.backend, self.response, self.choices = backend, response, choices
        self._open = True

    def close(self, finished: bool = False) -> None:
        if self._open:
            self._open = False
            self.backend.in_flight -= 1
            self.response.release() if finished else self.response.close()

    async def __aiter__(self) -> AsyncIterator[Completion]:
        finished = False
        try:
            if self.response.content_type == "application/json":
                pieces = whole_answer(self.backend, await self.response.read(), self.choices)
            else:
                pieces = self._events()
            async for piece in _aiter(pieces):
                yield piece
            finished = self._open
            if finished:  # a long stream's end is a later sign of life than its start
                self.backend.liveness.answered(time.monotonic())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            if self._open:  # not cut by us
                self.backend.failures += 1
            raise BackendError(f"backend {self.backend.address} broke off mid-stream: {exc}") from exc
        finally:
            self.close(finished)

    async def _events(self) -> AsyncIterator[Completion]:
        """The server-sent events' pieces, up to ``[DONE]``; ``BackendError`` if the body ends unfinished."""
        ended: set[int] = set()
        async for raw in self.response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                _check_every_choice_ended(self.backend, ended, self.choices, "ended its stream")
                return
            chunk = orjson.loads(payload)
            if not isinstance(chunk, dict) or "error" in chunk:
                error = chunk.get("error") if isinstance(chunk, dict) else f"not a completion chunk: {chunk!r:.200}"
                raise BackendError(f"backend {self.backend.address} failed mid-stream: {error}")
            for choice in chunk.get("choices") or []:
                piece = self._piece(choice)
                if piece.finish_reason:
                    ended.add(piece.index)
                yield piece
        if self._open:  # the body ended, not cut by us
            self.backend.failures += 1
            raise BackendError(f"backend {self.backend.address} ended its stream before [DONE]: an unfinished "
                               "reply")

    def _piece(self, choice: Any) -> Completion:
        """One choice of a chunk; a malformed one is the engine's fault (502), not the gateway's (500)."""
        try:
            ids = _ids_of(choice) if (choice.get("token_ids") or choice.get("logprobs")) else []
            return Completion(choice["index"], ids, _logprobs_of(choice) if ids else [], choice.get("text") or "",
                              choice.get("finish_reason"))
        except (BackendError, AttributeError, KeyError, TypeError) as exc:
            self.backend.failures += 1
            raise BackendError(f"backend {self.backend.address} streamed {exc}") from None


async def _aiter(pieces: list[Completion] | AsyncIterator[Completion]) -> AsyncIterator[Completion]:
    """A whole answer's choices or a stream's pieces, iterated alike."""
    if isinstance(pieces, list):
        for piece in pieces:
            yield piece
    else:
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                yield piece
