"""A chat completions call answered in Anthropic's shape: one message, or its server-sent events.

The call is ``gateway.chat.completions``'s (the same prompt, engine call, token-exact step published
and acknowledged before the answer ends); only the answer differs. A message's
``content`` is a text block (what the model wrote before its first tool call, trailing
white space dropped, or all of it) and a ``tool_use`` block per tool call, whose
``input`` is the call's arguments: a call whose arguments are not a JSON object leaves the
whole output as text, as a malformed call does (the model's output, not the gateway's
error). The conversation the trajectory keeps is that same text and those calls, so an
agent that sends the answer back continues the captured tokens.

``stop_reason``: ``tool_use`` when the answer calls tools, ``max_tokens`` when the engine
stopped at the limit, ``stop_sequence`` (with ``stop_sequence``, the one found in the
decoded response) when the engine stopped on a stop string rather than on its stop id,
else ``end_turn``.

Streamed, the events are Anthropic's: ``message_start``, per block ``content_block_start``,
``content_block_delta`` (``text_delta`` as the engine samples, held back at a possible
tool call; one ``input_json_delta`` per call once parsed), ``content_block_stop``, then
``message_delta`` (``stop_reason``, ``usage``) after the broker acknowledged the step, and
``message_stop``. A failure once the stream began is an ``error`` event.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Collection

from starlette.responses import JSONResponse

from trajbus.gateway.chat.completions import ChatCall
from trajbus.gateway.engine.calls import backend_failure
from trajbus.gateway.engine.pool import BackendError, Completion, NoBackendAvailable
from trajbus.gateway.errors import GatewayError
from trajbus.gateway.http.responses import OrjsonResponse, sse_event
from trajbus.gateway.prompts import tool_calls

log = logging.getLogger("trajbus.gateway")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}
"""Anthropic's error ``type`` by HTTP status; another 5xx is ``api_error``, another 4xx ``invalid_request_error``."""


def error_body(error: GatewayError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``: Anthropic's error, from the gateway's."""
    kind = ERROR_TYPES.get(error.status) or ("api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: GatewayError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return JSONResponse(error_body(error), error.status, headers=headers)


def parse(text: str, tools: bool) -> tool_calls.ParsedOutput:
    """Content and tool calls (``toolu_`` ids) of generated text, by the rule of the module docstring."""
    if not tools or tool_calls.OPEN not in text:
        return tool_calls.ParsedOutput(text, [])
    calls = []
    for call in tool_calls.parse(text).tool_calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            return tool_calls.ParsedOutput(text, [])
        if not isinstance(arguments, dict):
            return tool_calls.ParsedOutput(text, [])
        calls.append({**call, "id": f"toolu_{uuid.uuid4().hex[:24]}"})
    if not calls:
        return tool_calls.ParsedOutput(text, [])
    return tool_calls.ParsedOutput(text[:text.index(tool_calls.OPEN)].rstrip() or None, calls)


def streamable(text: str, tools: bool) -> int:
    """How much of ``text`` can be streamed as text: with tools, up to a possible tool call, less the white
    space that may precede one (not content if a call follows)."""
    if not tools:
        return len(text)
    end = tool_calls.safe_prefix(text)
    while end and text[end - 1].isspace():
        end -= 1
    return end


def content_blocks(parsed: tool_calls.ParsedOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": parsed.content}] if parsed.content else []
    return blocks + [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                      "input": json.loads(call["function"]["arguments"])} for call in parsed.tool_calls]


def stop_reason(completion: Completion, parsed: tool_calls.ParsedOutput, stops: list[str] | None,
                stop_ids: Collection[int], decode: Callable[[list[int]], str]) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished choice (see the module docstring)."""
    if parsed.tool_calls:
        return "tool_use", None
    if completion.finish_reason == "length":
        return "max_tokens", None
    if stops and completion.token_ids and completion.token_ids[-1] not in stop_ids:
        sampled = decode(completion.token_ids)  # the engine's text leaves the stop string out; its ids do not
        found = [(sampled.find(stop), stop) for stop in stops if stop in sampled]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


class MessagesCall(ChatCall):
    """One ``/v1/messages`` call of one trajectory: a chat call with Anthropic's answer."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.id = f"msg_{uuid.uuid4().hex}"

    def _parse(self, completion: Completion) -> tool_calls.ParsedOutput:
        return parse(completion.text, bool(self.request.tools))

    def _stop(self, completion: Completion, parsed: tool_calls.ParsedOutput) -> tuple[str, str | None]:
        tokenizer = self.parts.tokenizer
        return stop_reason(completion, parsed, self.request.stop, tokenizer.stop_ids, tokenizer.decode)

    async def complete(self) -> OrjsonResponse:
        await self.generate()
        parsed = (await self.settle())[0]
        completion = self.generation.choices[0]
        reason, sequence = self._stop(completion, parsed)
        return OrjsonResponse({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                               "content": content_blocks(parsed), "stop_reason": reason, "stop_sequence": sequence,
                               "usage": {"input_tokens": len(self.prompt_ids),
                                         "output_tokens": len(completion.token_ids)}})

    def _started(self) -> bytes:
        return sse_event(name="message_start", payload={"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(self.prompt_ids), "output_tokens": 0}}})

    async def _events(self) -> AsyncIterator[bytes]:
        tools, text, sent = bool(self.request.tools), "", 0
        try:
            yield self._started()
            async with contextlib.aclosing(self.generation.pieces()) as pieces:
                async for piece in pieces:
                    text += piece.text
                    ready = streamable(text, tools)
                    if ready > sent:
                        if not sent:
                            yield _block_start(0, {"type": "text", "text": ""})
                        yield _delta(0, {"type": "text_delta", "text": text[sent:ready]})
                        sent = ready
            parsed = (await self.settle())[0]
        except (NoBackendAvailable, BackendError, GatewayError) as exc:
            error = exc if isinstance(exc, GatewayError) else backend_failure(exc)
            log.warning("messages stream failed trajectory=%s error=%s", self.trajectory.trajectory_uid,
                        error.message)
            yield sse_event(name="error", payload=error_body(error))
            return
        for chunk in _finish(parsed, sent):
            yield chunk
        completion = self.generation.choices[0]
        reason, sequence = self._stop(completion, parsed)
        yield sse_event(name="message_delta", payload={"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": {"input_tokens": len(self.prompt_ids),
                                                "output_tokens": len(completion.token_ids)}})
        yield sse_event(name="message_stop", payload={"type": "message_stop"})


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    return sse_event({"type": "content_block_start", "index": index, "content_block": block}, "content_block_start")


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return sse_event({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")


def _block_stop(index: int) -> bytes:
    return sse_event({"type": "content_block_stop", "index": index}, "content_block_stop")


def _finish(parsed: tool_calls.ParsedOutput, sent: int) -> list[bytes]:
    """The events after the engine's last token: the rest of the text, then each tool call as a block."""
    chunks, text = [], parsed.content or ""
    if len(text) > sent:
        if not sent:
            chunks.append(_block_start(0, {"type": "text", "text": ""}))
        chunks.append(_delta(0, {"type": "text_delta", "text": text[sent:]}))
    index = 1 if text else 0
    if text:
        chunks.append(_block_stop(0))
    for block in content_blocks(parsed)[index:]:
        chunks.append(_block_start(index, {**block, "input": {}}))
        chunks.append(_delta(index, {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
        chunks.append(_block_stop(index))
        index += 1
    return chunks
