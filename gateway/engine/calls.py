"""Every engine call the gateway makes, one part: chat completions, Anthropic's messages and ``/generate``.

A call's prompt is checked against ``--prompt-length``, the call is held while a weight update pauses
generation (``gateway.engine.updates``), and its ``Generation`` streams from the engines (or takes one JSON
answer, ``--engine-streaming``); an engine's failure is the agent's error with the engine's status (502 when
it gave none), no engine the agent's 503 ``no_backend``. ``GatewayService`` builds it once and hands it to each caller.
"""

from __future__ import annotations

from typing import Any, Callable

from trajbus.gateway.config import GatewaySettings
from trajbus.gateway.engine.generation import Generation
from trajbus.gateway.engine.pool import BackendError, BackendPool, NoBackendAvailable
from trajbus.gateway.engine.updates import UpdateGate
from trajbus.gateway.errors import RETRY_SECONDS, GatewayError, bad_request, unavailable
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.prompts.token_ids import AnyIds


def backend_failure(exc: Exception) -> GatewayError:
    """An engine's failure as the agent's error: 503 ``no_backend`` when none answers, else the engine's status
    (a 400 is the request's fault; 5xx are retried after ``RETRY_SECONDS``)."""
    if isinstance(exc, NoBackendAvailable):
        return unavailable(str(exc), code="no_backend")
    status = getattr(exc, "status", 502)
    return GatewayError(status, str(exc), type_="invalid_request_error" if status == 400 else "backend_error",
                        code="backend_error", retry_after=RETRY_SECONDS if status >= 500 else None)


class EngineCalls:
    """Checks, holds and runs engine calls over the pool and the update gate it is given."""

    def __init__(self, settings: GatewaySettings, pool: BackendPool, updates: UpdateGate, metrics: GatewayMetrics,
                 stop_ids: Callable[[], frozenset[int]]) -> None:
        self.settings, self.pool, self.updates, self.metrics = settings, pool, updates, metrics
        self._stop_ids = stop_ids
        """The tokenizer's stop ids, read per call (the tokenizer loads after the server starts)."""

    def check_length(self, prompt_ids: AnyIds, what: str = "messages") -> None:
        """400 ``context_length_exceeded`` for a prompt over ``--prompt-length``, as OpenAI words it."""
        limit = self.settings.prompt_length
        if len(prompt_ids) > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your {what} "
                              f"resulted in {len(prompt_ids)} tokens.", param=what, code="context_length_exceeded")

    async def hold(self, wait: float) -> None:
        """Wait while generation is paused for a weight update, up to ``wait`` seconds, else 429; the caller reads
        the version and the engine to stamp the call with after this, so a held call gets the resumed ones."""
        await self.updates.hold(wait)

    def generation(self, prompt_ids: AnyIds, sampling: dict[str, Any], version: int, preferred: str | None,
                   stream: bool) -> Generation:
        """The call's generation, not started. ``stream``: the client reads the pieces as they come (one token
        per engine event)."""
        settings = self.settings
        return Generation(self.pool, self.updates, self.metrics, prompt_ids, sampling, version, preferred,
                          self._stop_ids(), stream or settings.engine_streaming == "always",
                          1 if stream else settings.engine_stream_interval)

    @staticmethod
    async def connect(generation: Generation) -> None:
        """The first engine call connected, before the agent is answered; a failure is the agent's error."""
        try:
            await generation.start()
        except (NoBackendAvailable, BackendError) as exc:
            raise backend_failure(exc) from None

    @staticmethod
    async def run(generation: Generation) -> None:
        """The generation run to its end; a failure is the agent's error."""
        try:
            await generation.start()
            await generation.run()
        except (NoBackendAvailable, BackendError) as exc:
            raise backend_failure(exc) from None
