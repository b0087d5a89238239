"""Weight updates through the gateway: pause, cut, resume, and what a call sees meanwhile.

A trainer that loads new weights into the engines first pauses every gateway
(``POST /admin/pause``). From then on a new engine call is held as admission
holds a new trajectory: up to ``?wait=SECONDS``, else answered 429 with
``Retry-After``. Every generation in flight is cut at the engine (its stream is
closed, so the engine stops at its next token) and keeps what it sampled; a
cut adds nothing to the engine's load while the weights change. The trainer
loads the weights, publishes the version and resumes (``POST /admin/resume``
with the version): each cut generation continues from prompt + partial
response under the new weights (``gateway.engine.generation``), and its step says
which version sampled which tokens (``streams.wire.versions``).

``drain`` pauses instead by holding new calls until the generations in flight
end by themselves: what an update costs when nothing is cut (the benchmark's
baseline). A generation read as one JSON answer (``--engine-streaming
when-asked``, a client that did not stream) cannot be cut: a pause waits for it.
A pause longer than ``--max-pause`` ends held and cut calls with 503
and ``Retry-After`` (nothing of theirs was published; the agent retries), instead
of holding them for as long as the update takes. Pause and resume are idempotent;
a resume to a version older than the one served is a 409.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from trajbus.gateway.errors import GatewayError, unavailable
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.state.served_version import ServedVersion

RETRY_SECONDS = 1
"""What a call refused during a pause is told to wait: updates usually take seconds."""


class Cuttable(Protocol):
    """A generation in flight, as the gate sees it."""

    cuttable: bool
    """False for one read as a single JSON answer (``--engine-streaming when-asked``): a pause waits for it."""

    def cut(self) -> list[asyncio.Task] | None:
        """Stop at the engine now; the tasks to await until its streams are closed (None: cut already)."""


class UpdateGate:
    """Whether generation is paused, and the generations in flight; a resume tells ``served`` its version."""

    def __init__(self, max_pause: float, metrics: GatewayMetrics, served: ServedVersion) -> None:
        self.max_pause, self.metrics, self.served = max_pause, metrics, served
        self.paused_at: float | None = None
        """``time.monotonic()`` of the pause in force, None while generating."""
        self.running: set[Cuttable] = set()
        self.held = 0
        """New calls waiting for the resume (``?wait=``): they begin under the version it brings."""
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._left = asyncio.Event()
        """Set (and replaced) whenever a generation leaves: a pause waiting for some to end looks again."""

    @property
    def paused(self) -> bool:
        return self.paused_at is not None

    def enter(self, generation: Cuttable) -> None:
        self.running.add(generation)

    def leave(self, generation: Cuttable) -> None:
        self.running.discard(generation)
        self._left.set()
        self._left = asyncio.Event()

    async def _until_ended(self, drain: bool) -> None:
        """Wait (up to the pause limit) until every generation in flight ended, or (not ``drain``) every
        one a pause cannot cut."""
        while any(drain or not g.cuttable for g in self.running) and self.remaining() > 0:
            try:
                await asyncio.wait_for(self._left.wait(), self.remaining())
            except asyncio.TimeoutError:
                return

    # -- the trainer's side ------------------------------------------------------------
    async def pause(self, drain: bool = False) -> dict[str, Any]:
        """Hold new engine calls and cut (or, ``drain``, wait out) the generations in flight. The answer
        says how many were cut and the version served."""
        if not self.paused:
            self.paused_at = time.monotonic()
            self._resumed = asyncio.Event()
            self.metrics.paused.set(1)
        cut = 0
        if not drain:
            readers = [tasks for g in list(self.running) if g.cuttable and (tasks := g.cut()) is not None]
            await asyncio.gather(*(task for tasks in readers for task in tasks), return_exceptions=True)
            cut = len(readers)
        await self._until_ended(drain)
        return {"paused": True, "cut": cut, "in_flight": len(self.running),
                "paused_seconds": round(time.monotonic() - self.paused_at, 3),
                "serving": self.served.serving()}

    def resume(self, version: int) -> dict[str, Any]:
        """Generate again, under ``version``; 409 when it is older than the version served."""
        self.served.resume(version)
        paused_for = 0.0
        if self.paused:
            paused_for = time.monotonic() - self.paused_at
            self.metrics.pause_seconds.observe(paused_for)
            self.paused_at = None
            self.metrics.paused.set(0)
            self._resumed.set()
        return {"paused": False, "version": version, "paused_seconds": round(paused_for, 3)}

    def remaining(self) -> float:
        """Seconds left before the pause in force passes ``--max-pause``."""
        return self.paused_at + self.max_pause - time.monotonic() if self.paused else self.max_pause

    # -- a call's side -----------------------------------------------------------------
    async def hold(self, wait: float) -> None:
        """A new engine call during a pause: held up to ``wait`` seconds, else 429 (503 past the limit)."""
        if not self.paused:
            return
        limit = max(self.remaining(), 0.0)
        self.held += 1
        try:
            if await self._wait(min(wait, limit)):
                return
        finally:
            self.held -= 1
        if wait >= limit:  # the pause limit, not the caller's wait, ended the hold
            raise self.too_long()
        raise GatewayError(429, "generation is paused for a weight update; retry shortly, or call with "
                                "?wait=SECONDS to be held until it resumes", type_="rate_limit_error",
                           code="paused_for_update", retry_after=RETRY_SECONDS)

    async def resumed(self) -> int | None:
        """A cut generation waits for the resume (503 past ``--max-pause``); the version to continue under."""
        if self.paused and not await self._wait(max(self.remaining(), 0.0)):
            self.metrics.generations.labels("expired").inc()
            raise self.too_long()
        return self.served.resumed

    async def _wait(self, seconds: float) -> bool:
        resumed = self._resumed
        if seconds > 0:
            try:
                await asyncio.wait_for(resumed.wait(), seconds)
            except asyncio.TimeoutError:
                pass
        return resumed.is_set()

    def too_long(self) -> GatewayError:
        return unavailable(f"generation has been paused for a weight update for more than {self.max_pause:g} s "
                           f"(--max-pause); retry once it resumes", code="paused_too_long",
                           retry_after=RETRY_SECONDS)

    def state(self) -> dict[str, Any]:
        return {"paused": self.paused, "version": self.served.resumed, "in_flight": len(self.running),
                "held": self.held,
                "paused_seconds": round(time.monotonic() - self.paused_at, 3) if self.paused else 0.0}
