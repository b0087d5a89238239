"""Black-box chat completions: OpenAI's API in front, one token-exact Step per call behind.

For every call the gateway builds the prompt ids (``gateway.prompts.conversation``: the
conversation's sampled tokens continued by the new messages, or the whole
conversation rendered when it does not extend), sends those ids to the engine,
and publishes the ids the engine sampled (``response_ids``, EOS included) with
one log-probability per id: nothing is re-encoded from text. The reply, plain or
streamed as OpenAI chunks, is built from the same generation; tool calls are
parsed from it when the request offers tools. Steps are acknowledged by the
broker before the reply completes (before ``finish_reason`` when streaming).

The trajectory's lifecycle publishes the steps (``TrajectoryLifecycle.publish_call``):
indices are taken when the engine has answered, under the trajectory's publish
lock, and only acknowledged steps count as the trajectory's (``gateway.state.trajectories``):
a call that fails, before or after the engine, never leaves an index for the worker
to wait on or for a retry to reuse.

The engine call is made by ``gateway.engine.calls`` (the one part every route's engine call
goes through), as a ``gateway.engine.generation``: streamed from the engine, cut by a
weight update and continued after it, so the agent gets one reply and the step
its tokens with the versions that sampled them (``policy_version`` is the
version the call began with). During a pause a new call is held up to
``?wait=SECONDS``, else answered 429 (``gateway.engine.updates``).

With tracing on (``--tracing``), the call, its engine request and its publish are spans
(``gateway.chat.call_spans``), the call's a child of the agent's ``traceparent`` when it sent one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from typing import Any, AsyncIterator, Callable

from trajbus.gateway.broker.kafka_link import KafkaLink
from trajbus.gateway.chat.call_spans import CallSpans, call_spans
from trajbus.gateway.config import GatewaySettings
from trajbus.gateway.engine.calls import EngineCalls, backend_failure
from trajbus.gateway.engine.generation import Generation, Sampled
from trajbus.gateway.engine.pool import BackendError, Completion
from trajbus.gateway.errors import GatewayError, bad_request
from trajbus.gateway.http.responses import SSE_DONE, EventSourceResponse, OrjsonResponse, sse_event
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.prompts import tool_calls
from trajbus.gateway.prompts.conversation import Prompt
from trajbus.gateway.prompts.tokenizer import ChatTokenizer
from trajbus.gateway.schemas import ChatCompletionRequest
from trajbus.gateway.state.lifecycle import TrajectoryLifecycle
from trajbus.gateway.state.trajectories import Trajectory
from trajbus.infra import tracing
from trajbus.streams.wire.records import SEGMENT_START

log = logging.getLogger("trajbus.gateway")


INLINE_CHARACTERS = 16384
"""New text up to this size (a few thousand tokens, about a millisecond to render and tokenize) is built on
the event loop; more, such as a whole conversation to render, in a worker thread, so other calls keep flowing."""


def check_logprobs(completion: Completion) -> None:
    if len(completion.logprobs) != len(completion.token_ids):
        raise GatewayError(502, f"backend returned {len(completion.logprobs)} log-probs for "
                                f"{len(completion.token_ids)} tokens", type_="backend_error", code="backend_error")


class ChatCompletions:
    """Serves chat completions from the parts it is given: tokenizer, engines, Kafka, trajectory rules."""

    def __init__(self, settings: GatewaySettings, require: Callable[..., None], tokenizer: ChatTokenizer,
                 engine: EngineCalls, kafka: KafkaLink, lifecycle: TrajectoryLifecycle,
                 metrics: GatewayMetrics) -> None:
        self.settings, self.require, self.tokenizer, self.engine = settings, require, tokenizer, engine
        """``require``: 503 unless the named parts are ready (``GatewayService.require``)."""
        self.kafka, self.lifecycle, self.metrics = kafka, lifecycle, metrics

    async def create(self, trajectory: Trajectory, request: ChatCompletionRequest, wait: float = 0.0,
                     traceparent: str | None = None):
        call = await self.prepare(trajectory, request, [m.for_template() for m in request.messages], wait,
                                  traceparent=traceparent)
        return await call.answer(bool(request.stream))

    async def prepare(self, trajectory: Trajectory, request: ChatCompletionRequest, messages: list[dict[str, Any]],
                      wait: float = 0.0, kind: type[ChatCall] | None = None,
                      traceparent: str | None = None) -> ChatCall:
        """The call of ``messages`` (the chat template's form), prompt built and engine call set up, not started;
        ``kind``: the ``ChatCall`` that answers it (another API's answer shape: ``gateway.anthropic.answers``);
        ``traceparent``: the agent's W3C trace context header, whose trace the call joins (tracing on)."""
        started_ns = time.time_ns()
        self.require("tokenizer", "kafka", "backend")
        prompts = self.tokenizer.prompts
        new = prompts.new_messages(messages, trajectory.last_conversation, trajectory.context_ids)
        build = functools.partial(prompts.build_new, messages, request.tools, new, trajectory.context_ids)
        try:
            rendered = messages if new is None else new
            if sum(len(m.get("content") or "") for m in rendered) <= INLINE_CHARACTERS:
                prompt = build()
            else:  # a long render would hold every other call: a worker thread does it
                prompt = await asyncio.to_thread(build)
        except Exception as exc:  # the template refused the conversation (e.g. roles out of order)
            raise bad_request(f"messages: the chat template cannot render this conversation: {exc}",
                              param="messages") from None
        self.engine.check_length(prompt.ids)
        await self.kafka.ensure_channel(trajectory.channel)  # Kafka down: 503 before the engine does any work
        sampling = request.engine_params(self.settings.response_length)
        await self.engine.hold(wait)  # then the version: a call held through an update is stamped with the new one
        generation = self.engine.generation(prompt.ids, sampling, self.lifecycle.policy_version(trajectory),
                                            trajectory.backend, bool(request.stream))
        call = (kind or ChatCall)(self, trajectory, request, messages, prompt, generation)
        call.spans = call_spans(trajectory, traceparent, started_ns)
        return call


class ChatCall:
    """One chat completion request of one trajectory."""

    def __init__(self, parts: ChatCompletions, trajectory: Trajectory, request: ChatCompletionRequest,
                 messages: list[dict[str, Any]], prompt: Prompt, generation: Generation) -> None:
        self.parts, self.trajectory, self.request = parts, trajectory, request
        self.messages, self.prompt, self.prompt_ids, self.generation = messages, prompt, prompt.ids, generation
        self.id = f"chatcmpl-{os.urandom(16).hex()}"  # uuid4's randomness, without building a UUID
        self.created = int(time.time())
        self.model = request.model or parts.settings.served_model_name
        self.started = time.monotonic()
        self.spans: CallSpans | None = None
        """The call's spans when tracing is on (``gateway.chat.call_spans``)."""

    def _parse(self, completion: Completion) -> tool_calls.ParsedOutput:
        if self.request.tools:
            return tool_calls.parse(completion.text)
        return tool_calls.ParsedOutput(completion.text, [])

    @staticmethod
    def _message(parsed: tool_calls.ParsedOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return message

    async def _publish(self, backend: str, completions: list[Sampled],
                       parsed: list[tool_calls.ParsedOutput]) -> None:
        """The call's steps, published by the trajectory's lifecycle (``TrajectoryLifecycle.publish_call``)."""
        t, parts = self.trajectory, self.parts
        parts.metrics.engine_latency.observe(time.monotonic() - self.started)
        version = self.generation.began_with  # the version the call began with, its steps' policy_version
        conversation = self.messages + [self._message(parsed[0])]
        if self.spans is None:
            steps = await parts.lifecycle.publish_call(t, self.prompt, completions, version, conversation, backend)
        else:
            with self.spans.publishing() as span:  # current only here: the records' traceparent names it
                steps = await parts.lifecycle.publish_call(t, self.prompt, completions, version, conversation,
                                                           backend)
                span.set_attribute(tracing.STEP_INDEX, steps[0].step_index)
        kind = "first" if t.context_step is None else "new_segment" if SEGMENT_START in steps[0].metadata \
            else "continued"
        parts.metrics.prompts_of[kind].inc()
        log.debug("chat step published trajectory=%s step=%d backend=%s prompt=%s", t.trajectory_uid,
                  steps[0].step_index, backend, kind)

    def _usage(self, completions: list[Completion]) -> dict[str, int]:
        generated = sum(len(c.token_ids) for c in completions)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": generated,
                "total_tokens": len(self.prompt_ids) + generated}

    async def answer(self, stream: bool) -> Any:
        """The answer, streamed or whole; the call's span (tracing on) ends with it."""
        spans = self.spans
        try:
            response = await (self.stream() if stream else self.complete())
        except BaseException as exc:
            if spans is not None:
                spans.end(exc)
            raise
        if spans is not None and not stream:
            spans.end()
        return response

    async def generate(self) -> None:
        """The engine call, run to its end; a backend's failure is the agent's 502 or 503."""
        if self.spans is not None:
            self.spans.engine_started()
        await self.parts.engine.run(self.generation)

    async def settle(self) -> list[tool_calls.ParsedOutput]:
        """The generation's choices checked, parsed and published (acknowledged): what every answer shape ends
        with before its last bytes."""
        completions = self.generation.choices
        if self.spans is not None:  # the engine's answer is whole
            self.spans.engine_ended(self.generation.backend, sum(len(c.token_ids) for c in completions))
        for completion in completions:
            check_logprobs(completion)
        parsed = [self._parse(c) for c in completions]
        await self._publish(self.generation.backend, completions, parsed)
        return parsed

    async def complete(self) -> OrjsonResponse:
        await self.generate()
        completions = self.generation.choices
        parsed = await self.settle()
        choices = [{"index": c.index, "message": self._message(p), "logprobs": None,
                    "finish_reason": "tool_calls" if p.tool_calls else c.finish_reason}
                   for c, p in zip(completions, parsed)]
        return OrjsonResponse({"id": self.id, "object": "chat.completion", "created": self.created,
                             "model": self.model, "choices": choices, "usage": self._usage(completions)})

    def _chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        payload = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        return sse_event(payload)

    async def stream(self) -> EventSourceResponse:
        if self.spans is not None:
            self.spans.engine_started()
        await self.parts.engine.connect(self.generation)  # before answering: no engine is a 503
        return EventSourceResponse(self._events() if self.spans is None else self._traced(self._events()))

    async def _traced(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The streamed answer; the call's spans end with it (sent, failed, or cut by the client)."""
        try:
            async with contextlib.aclosing(events) as inner:
                async for chunk in inner:
                    yield chunk
        finally:
            self.spans.end()

    async def _events(self) -> AsyncIterator[bytes]:
        completions = self.generation.choices
        texts, sent = [""] * len(completions), [0] * len(completions)  # as handed on: one chunk per piece
        try:
            for choice in completions:
                yield self._chunk(choice.index, {"role": "assistant", "content": ""})
            async with contextlib.aclosing(self.generation.pieces()) as pieces:
                async for piece in pieces:
                    i = piece.index
                    texts[i] += piece.text
                    ready = tool_calls.safe_prefix(texts[i]) if self.request.tools else len(texts[i])
                    if ready > sent[i]:
                        yield self._chunk(i, {"content": texts[i][sent[i]:ready]})
                        sent[i] = ready
            parsed = await self.settle()
        except (BackendError, GatewayError) as exc:
            error = backend_failure(exc) if isinstance(exc, BackendError) else exc
            log.warning("chat stream failed trajectory=%s error=%s", self.trajectory.trajectory_uid, error.message)
            yield sse_event(error.body())
            return
        for choice, output in zip(completions, parsed):
            if output.tool_calls:
                calls = [{"index": k, **call} for k, call in enumerate(output.tool_calls)]
                yield self._chunk(choice.index, {"tool_calls": calls})
            elif sent[choice.index] < len(choice.text):
                yield self._chunk(choice.index, {"content": choice.text[sent[choice.index]:]})
            yield self._chunk(choice.index, {}, "tool_calls" if output.tool_calls else choice.finish_reason)
        if (self.request.stream_options or {}).get("include_usage"):
            usage = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                     "choices": [], "usage": self._usage(completions)}
            yield sse_event(usage)
        yield SSE_DONE
