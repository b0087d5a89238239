"""What an engine answered, read into choices: one JSON answer, or a stream read a batch at a time.

The gateway streams every call from the engine (so a weight update can cut it), and
an engine streams one server-sent event per token. Read one line at a time, with a
JSON parse, an object and an event-loop wake-up for each, the stream cost the gateway
more CPU than the rest of the call (issue 31). So a stream is read as the bytes that
arrived (``StreamDecoder``): their complete events are split in one pass, their
JSON parsed in one call, and their tokens merged into one piece per choice. An
optional read interval lets a fast engine's events pile up between reads, so a
read holds many tokens. What a cut keeps is unchanged: every complete event that
was read, nothing of a partial one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import aiohttp
import orjson

from trajbus.gateway.engine.health import Liveness

TOKEN_ID_PREFIX = "token_id:"
DONE = b"[DONE]"


class BackendError(RuntimeError):
    """A backend answered with an error or broke off after the request reached it."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class AnsweringBackend(Protocol):
    """What reading an answer needs of its backend: its name, its failure count and its liveness."""

    address: str
    failures: int
    in_flight: int
    liveness: Liveness


@dataclass
class Completion:
    """One choice as the engine produced it, or (streaming) the next piece of one."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


NO_TOKEN_IDS = "no token ids (needs vLLM's return_tokens_as_token_ids or return_token_ids)"
_SEPARATED_PREFIX = "," + TOKEN_ID_PREFIX


def prefixed_ids(tokens: list[str]) -> list[int]:
    """vLLM's ``token_id:N`` strings as ids, parsed by C loops over one joined string, not a Python step per
    token (a 2000-token reply is parsed once per call, on the gateway's event loop). Every token must be
    exactly the prefix and an integer: one without the prefix, or with anything around its number, is the
    engine's fault."""
    if not tokens:
        return []
    try:
        separated = "," + ",".join(tokens)
    except TypeError:  # a token that is no string
        raise BackendError(NO_TOKEN_IDS) from None
    if separated.count(",") != len(tokens) or separated.count(_SEPARATED_PREFIX) != len(tokens):
        raise BackendError(NO_TOKEN_IDS)  # a comma inside a token, or one without the prefix
    try:  # each prefix removed where a token begins; one inside a token leaves it no integer
        return list(map(int, separated.replace(_SEPARATED_PREFIX, ",")[1:].split(",")))
    except ValueError:
        raise BackendError(NO_TOKEN_IDS) from None


def _ids_of(choice: dict[str, Any]) -> list[int]:
    if choice.get("token_ids") is not None:
        return list(map(int, choice["token_ids"]))
    return prefixed_ids((choice.get("logprobs") or {}).get("tokens") or [])


def _logprobs_of(choice: dict[str, Any]) -> list[float]:
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    if values is None:
        raise BackendError("no log-probabilities")
    return list(map(float, values))


def check_every_choice_ended(backend: AnsweringBackend, ended: set[int], choices: int, what: str) -> None:
    """An answer counts only once each of its choices has ended (a ``finish_reason``); else it is the engine's
    fault, so no truncated reply is answered 200 nor published for the trainer."""
    missing = sorted(set(range(choices)) - ended)
    if missing:
        backend.failures += 1
        raise BackendError(f"backend {backend.address} {what} without finishing choice(s) {missing}: "
                           "an unfinished reply")


def whole_answer(backend: AnsweringBackend, raw: bytes, choices: int) -> list[Completion]:
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
    check_every_choice_ended(backend, {c.index for c in answer}, choices, "answered")
    return sorted(answer, key=lambda c: c.index)


BODY_END_SECONDS = 1.0
"""How long a stream's body may take to end after its ``[DONE]`` before its connection is dropped."""


async def read_to_end(content: aiohttp.StreamReader) -> None:
    """What follows ``[DONE]`` (the chunked body's terminator, which can come in a later packet) read, so
    releasing the response gives its connection back to the pool: aiohttp closes a connection whose body
    was not read to its end, and the next call then pays a new one on both sides (0.5 ms of CPU per engine
    call in an in-process probe at one call at a time). A body that does not end soon is left to that close."""
    if content.at_eof():  # ended already (most calls): no timer to set
        return
    with contextlib.suppress(TimeoutError, aiohttp.ClientError):  # the answer is whole: only the connection is lost
        async with asyncio.timeout(BODY_END_SECONDS):
            while await content.readany():
                pass


class StreamDecoder:
    """Server-sent events in, as the bytes arrive; each batch's complete events out as data payloads.

    The event-stream rules: lines end with LF, CRLF or CR; ``data:`` lines of one event are joined with
    LF, a blank line ends the event, ``:`` starts a comment, ``event:`` names the event (kept, so an
    ``error`` event is not read as a completion), other fields are ignored. A partial line or event waits
    for the next batch; one left at the end of the body is dropped, as the rules say. A CR ends its line
    at once (an event it completes is not held back, and a body may end with it); an LF right after it,
    in the same batch or first in the next, is its CRLF's.
    """

    def __init__(self) -> None:
        self._partial = b""
        self._after_cr = False
        self._data: list[bytes] = []
        self._event = b""

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The events completed by ``data``: (event name, empty for the default one; data)."""
        if self._after_cr and data[:1] == b"\n":  # the LF of a CRLF split between two batches
            data = data[1:]
        buffer = self._partial + data
        self._after_cr = buffer.endswith(b"\r")
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        end = buffer.rfind(b"\n")
        self._partial = buffer[end + 1:]
        if end < 0:
            return []
        events = []
        for line in buffer[:end].split(b"\n"):
            if not line:
                if self._data:
                    events.append((self._event, b"\n".join(self._data)))
                self._data, self._event = [], b""
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line.startswith(b"event:"):
                self._event = line[6:].strip()
        return events


def _chunks(backend: AnsweringBackend, payloads: list[bytes]) -> list[Any]:
    """Completion chunks (one parse each: faster here than one parse of them joined); one that is not JSON
    is named."""
    try:
        return [orjson.loads(payload) for payload in payloads]
    except orjson.JSONDecodeError as exc:
        backend.failures += 1
        bad = next(p for p in payloads if not _is_json(p))
        raise BackendError(f"backend {backend.address} streamed an event that is not JSON ({exc}): "
                           f"{bad[:200]!r}") from None


def _is_json(payload: bytes) -> bool:
    try:
        orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return True


def merge_chunks(backend: AnsweringBackend, chunks: list[Any], ended: set[int]) -> list[Completion]:
    """The chunks' choices, one piece per choice in the order first seen, tokens in order; the choices that
    got their ``finish_reason`` join ``ended``. vLLM's ``token_id:N`` strings of a piece are parsed together,
    once for all its chunks (an engine streams a chunk per event, about 20 a reply at 16 tokens an event). A
    malformed choice is the engine's fault (502), not the gateway's (500)."""
    merged: dict[int, Completion] = {}
    strings: dict[int, tuple[list[str], list[Any]]] = {}
    """Per piece, the ``token_id:N`` strings and their log-probs not parsed yet."""
    for chunk in chunks:
        if not isinstance(chunk, dict) or "error" in chunk:
            error = chunk.get("error") if isinstance(chunk, dict) else f"not a completion chunk: {chunk!r:.200}"
            raise BackendError(f"backend {backend.address} failed mid-stream: {error}")
        for choice in chunk.get("choices") or ():
            try:
                index = choice["index"]
                piece = merged.get(index)
                if piece is None:
                    piece = merged[index] = Completion(index)
                logprobs = choice.get("logprobs")
                if logprobs and choice.get("token_ids") is None:  # vLLM's shape: "token_id:N" strings
                    tokens, values = logprobs.get("tokens") or (), logprobs.get("token_logprobs")
                    if tokens:
                        if values is None:
                            raise BackendError("no log-probabilities")
                        pending = strings.setdefault(index, ([], []))
                        pending[0].extend(tokens)
                        pending[1].extend(values)
                elif choice.get("token_ids") or logprobs:
                    ids = _ids_of(choice)
                    if ids:
                        _parse_strings(piece, strings.pop(index, None))  # the ids stay in their order
                        piece.token_ids += ids
                        piece.logprobs += _logprobs_of(choice)
                if text := choice.get("text"):
                    piece.text += text
                if reason := choice.get("finish_reason"):
                    piece.finish_reason = reason
                    ended.add(index)
            except (BackendError, AttributeError, KeyError, TypeError) as exc:
                raise _streamed_fault(backend, exc) from None
    try:
        for index, pending in strings.items():
            _parse_strings(merged[index], pending)
    except (BackendError, TypeError) as exc:
        raise _streamed_fault(backend, exc) from None
    return list(merged.values())


def _streamed_fault(backend: AnsweringBackend, exc: Exception) -> BackendError:
    """The engine's fault in what it streamed, counted against it."""
    backend.failures += 1
    return BackendError(f"backend {backend.address} streamed {exc}")


def _parse_strings(piece: Completion, pending: tuple[list[str], list[Any]] | None) -> None:
    """A piece's ``token_id:N`` strings (and their log-probs) appended to it as ids."""
    if pending is not None:
        piece.token_ids += prefixed_ids(pending[0])
        piece.logprobs += map(float, pending[1])


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

    ``read_interval``: seconds to wait after a read before the next (0: read as soon as bytes arrive).
    """

    def __init__(self, backend: AnsweringBackend, response: aiohttp.ClientResponse, choices: int = 1,
                 read_interval: float = 0.0) -> None:
        self.backend, self.response, self.choices = backend, response, choices
        self.read_interval = read_interval
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
                for piece in whole_answer(self.backend, await self.response.read(), self.choices):
                    yield piece
            else:
                async for pieces in self._batches():
                    for piece in pieces:
                        yield piece
            finished = self._open
            if finished:  # a long stream's end is a later sign of life than its start
                self.backend.liveness.answered(time.monotonic())
                await read_to_end(self.response.content)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            if self._open:  # not cut by us
                self.backend.failures += 1
            raise BackendError(f"backend {self.backend.address} broke off mid-stream: {exc}") from exc
        finally:
            self.close(finished)

    async def _batches(self) -> AsyncIterator[list[Completion]]:
        """Each read's pieces, up to ``[DONE]``; ``BackendError`` if the body ends unfinished."""
        decoder, content, ended = StreamDecoder(), self.response.content, set[int]()
        while data := await content.readany():
            payloads = []
            for name, payload in decoder.feed(data):
                if name == b"error":
                    raise BackendError(f"backend {self.backend.address} failed mid-stream: {payload[:2000]!r}")
                if payload == DONE:
                    if payloads:
                        yield merge_chunks(self.backend, _chunks(self.backend, payloads), ended)
                    check_every_choice_ended(self.backend, ended, self.choices, "ended its stream")
                    return
                payloads.append(payload)
            if payloads:
                yield merge_chunks(self.backend, _chunks(self.backend, payloads), ended)
            if self.read_interval:
                await asyncio.sleep(self.read_interval)
        if self._open:  # the body ended, not cut by us
            self.backend.failures += 1
            raise BackendError(f"backend {self.backend.address} ended its stream before [DONE]: an unfinished "
                               "reply")
