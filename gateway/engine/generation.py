"""One engine call that a weight update may cut, and its continuation after the update.

The gateway streams from the engine even for a client that asked for one JSON
answer: what a generation has sampled so far (ids, log-probs, text) is then the
gateway's, so a cut (``gateway.engine.updates``) loses nothing. After the resume, each
unfinished choice continues as an engine call of its own from prompt + partial
response, with ``max_tokens`` less what it sampled, under the new version; its
``Segments`` record which version sampled which tokens. A choice whose partial
response ends with a stop id (EOS), or that used up ``max_tokens``, is finished
as it stands. A stop string that spans the cut is not seen by the engine (it
sees each side alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from trajbus.gateway.engine.answers import Completion, EngineStream
from trajbus.gateway.engine.pool import BackendPool
from trajbus.gateway.engine.updates import UpdateGate
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.prompts.token_ids import AnyIds, joined
from trajbus.streams.wire.versions import Segments

_END = object()
"""A reader's last item on the round's queue."""


def _reader_done(stream: EngineStream, queue: asyncio.Queue | None, task: asyncio.Task) -> None:
    """A reader ended: its stream is closed (if it had not ended), and one cut before it began still ends."""
    stream.close()
    if task.cancelled() and queue is not None:
        queue.put_nowait(_END)


@dataclass
class Sampled(Completion):
    """One choice as sampled so far, over every engine call it took."""

    segments: Segments = field(default_factory=Segments)

    def add(self, piece: Completion, version: int) -> None:
        self.token_ids += piece.token_ids
        self.logprobs += piece.logprobs
        self.text += piece.text
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.segments.add(len(piece.token_ids), version)


class Generation:
    """Streams one call's choices from the engines across cuts (see the module docstring)."""

    def __init__(self, pool: BackendPool, gate: UpdateGate, metrics: GatewayMetrics, prompt_ids: AnyIds,
                 sampling: dict[str, Any], version: int, preferred: str | None, stop_ids: frozenset[int],
                 cuttable: bool = True, stream_interval: int = 1) -> None:
        self.pool, self.gate, self.metrics = pool, gate, metrics
        self.prompt_ids, self.sampling, self.version = prompt_ids, sampling, version
        self.began_with = version
        """The version the call began with (its step's ``policy_version``); ``version``: the one sampling now."""
        self.backend, self.stop_ids = preferred, stop_ids
        self.choices = [Sampled(i) for i in range(sampling.get("n") or 1)]
        self.cuttable = cuttable
        """False: one JSON answer from the engine, which a weight update cannot cut: the pause waits for it
        (``--engine-streaming when-asked``)."""
        self.stream_interval = stream_interval
        """Tokens per engine event (``--engine-stream-interval``) when no client reads the pieces as they come."""
        self.cuts = 0
        self._kept = 0
        """Tokens sampled before the last cut (counted once in ``cut_tokens``)."""
        self._cut = False
        self._opened: list[tuple[EngineStream, list[int]]] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Connect the first engine call, before the client is answered (no backend: the caller's 503)."""
        self.gate.enter(self)
        if not self.cuttable:  # connected by run()
            return
        try:
            self.backend, stream = await self.pool.stream(self.prompt_ids, self.sampling, self.backend,
                                                          self.stream_interval)
        except BaseException:
            self.gate.leave(self)
            raise
        self._opened = [(stream, list(range(len(self.choices))))]

    def cut(self) -> list[asyncio.Task] | None:
        """``gateway.engine.updates``: stop reading (the engine stops at its next token); the readers to await
        (none while it connects), or None when it was cut already and waits for the resume."""
        if self._cut:
            return None
        self._cut = True
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()
        return tasks

    async def run(self) -> None:
        """Every choice to its end, across cuts, handing no piece on (a client that wants one answer:
        no queue between the readers and the caller, so a token costs its parse)."""
        if not self.cuttable:
            try:
                self.backend, completions = await self.pool.complete(self.prompt_ids, self.sampling, self.backend)
            finally:
                self.gate.leave(self)
            for completion in completions:
                self.choices[completion.index].add(completion, self.version)
            return
        async with contextlib.aclosing(self._generate(hand_on=False)) as pieces:
            async for _piece in pieces:
                pass

    def pieces(self) -> AsyncIterator[Completion]:
        """Every piece as it arrives, its index the choice's, across cuts; ends once every choice has.
        Iterate it under ``contextlib.aclosing``: a caller cancelled mid-way closes the engine streams at once."""
        return self._generate(hand_on=True)

    async def _generate(self, hand_on: bool) -> AsyncIterator[Completion]:
        try:
            while True:
                async for piece in self._round(hand_on):
                    yield piece
                if not self._cut or not self._unfinished():
                    break
                await self._continue()
        finally:
            for task in self._tasks:
                task.cancel()
            for stream, _ in self._opened:
                stream.close()
            self.gate.leave(self)
        for choice in self.choices:
            choice.finish_reason = choice.finish_reason or "stop"

    async def _round(self, hand_on: bool) -> AsyncIterator[Completion]:
        if self._cut:  # cut while connecting: the engine stops before it sends anything
            for stream, _ in self._opened:
                stream.close()
            return
        queue: asyncio.Queue | None = asyncio.Queue() if hand_on else None
        self._tasks = []
        for stream, indices in self._opened:
            task = asyncio.create_task(self._read(stream, indices, self.version, queue))
            task.add_done_callback(functools.partial(_reader_done, stream, queue))
            self._tasks.append(task)
        if queue is None:
            outcomes = await asyncio.gather(*self._tasks, return_exceptions=True)
            failures = [f for f in outcomes if isinstance(f, Exception)]
            if failures:
                raise failures[0]
            return
        left = len(self._tasks)
        while left:
            item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    async def _read(self, stream: EngineStream, indices: list[int], version: int,
                    queue: asyncio.Queue | None) -> Exception | None:
        """One engine stream into its choices (and onto ``queue``); a failure is returned or queued."""
        try:
            async for piece in stream:
                piece.index = indices[piece.index]
                self.choices[piece.index].add(piece, version)
                if queue is not None:
                    queue.put_nowait(piece)
        except asyncio.CancelledError:
            stream.close()  # a cut: what arrived is kept
        except Exception as exc:  # noqa: BLE001 - the caller's to raise
            if queue is None:
                return exc
            queue.put_nowait(exc)
        finally:
            if queue is not None:
                queue.put_nowait(_END)
        return None

    def _unfinished(self) -> list[Sampled]:
        """Choices still to generate; one ended by a stop id or by max_tokens is finished as it is."""
        unfinished = []
        for choice in self.choices:
            if choice.finish_reason is None and choice.token_ids and choice.token_ids[-1] in self.stop_ids:
                choice.finish_reason = "stop"
            elif choice.finish_reason is None and len(choice.token_ids) >= self.sampling["max_tokens"]:
                choice.finish_reason = "length"
            elif choice.finish_reason is None:
                unfinished.append(choice)
        return unfinished

    async def _continue(self) -> None:
        """After a cut: wait for the resume (503 past --max-pause), then open a call per unfinished choice."""
        self.cuts += 1
        self.metrics.generations.labels("cut").inc()
        sampled = sum(len(c.token_ids) for c in self.choices)
        self.metrics.cut_tokens.inc(sampled - self._kept)
        self._kept = sampled
        version = await self.gate.resumed()
        self.version = version if version is not None else self.version
        self._cut = False
        self._opened = []
        for choice in self._unfinished():
            sampling = {**self.sampling, "n": 1, "max_tokens": self.sampling["max_tokens"] - len(choice.token_ids)}
            self.backend, stream = await self.pool.stream(joined(self.prompt_ids, choice.token_ids), sampling,
                                                          self.backend, self.stream_interval)
            self._opened.append((stream, [choice.index]))
        self.metrics.generations.labels("continued").inc()
