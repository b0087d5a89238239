"""Anthropic's Messages request as the conversation the chat completions route captures.

An agent on Anthropic's SDK (``POST {base_url}/v1/messages``) and one on OpenAI's
(``POST {base_url}/chat/completions``) describe the same thing: a list of turns and the
tools on offer. This module writes Anthropic's request as the chat template's messages
(OpenAI's shape, which the templates read): ``system`` (a string or text blocks) becomes
the first ``system`` message; an assistant's ``tool_use`` blocks become its
``tool_calls`` (``input`` as JSON arguments); each ``tool_result`` block becomes a
``tool`` message answering ``tool_use_id``, in the order of the blocks, and a user's
text blocks a ``user`` message between them (text blocks are joined as they are, as
chat completions join text parts; consecutive messages of one role stay turns of their
own). Tools become ``function`` tools (``input_schema`` as ``parameters``, in OpenAI's
order of keys: a template may write a tool's JSON as it is). The call then goes through
the chat completions pipeline (``gateway.chat.completions``): the same prompt building, cumulative
token capture and publication; only the answer's shape differs
(``gateway.anthropic.answers``).

One trajectory may mix the two APIs, call by call. It is well defined because the
trajectory's state is the conversation in this one form and its token ids
(``gateway.prompts.conversation``): whichever API a call comes through, its messages are
compared with the conversation the trajectory holds (roles, content, tool names and
arguments as JSON, ``tool_call_id``) and rendered by the same chat template, so a call
that continues the conversation extends the previous prompt + response, and one that
does not starts a new segment, as it would through one API alone. Tool call ids differ
in form (``call_...``, ``toolu_...``) but are not part of that comparison, and a
``tool_result`` names the id the agent was given, whichever API gave it.

What the chat template cannot hold is refused with a 400 naming it: images and documents
(by the request schema, ``gateway.anthropic.schemas``) and a last message from the
assistant (Anthropic's prefill asks the model to continue that message; the template
would open a new turn instead, so the captured tokens would not be what was asked).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from trajbus.gateway.anthropic.schemas import (AssistantMessage, MessagesRequest, TextBlock, Tool, ToolResultBlock,
                                               ToolUseBlock, UserMessage)
from trajbus.gateway.errors import bad_request, from_validation_error
from trajbus.gateway.schemas import ChatCompletionRequest

NOT_SETTINGS = frozenset({"name", "type", "description", "input_schema", "cache_control"})
"""Fields of a typed tool that are not its settings (``display_width_px``, ... are)."""


def _text(blocks: list[TextBlock]) -> str:
    return "".join(block.text for block in blocks)


def _user(message: UserMessage) -> list[dict[str, Any]]:
    """A user message: its tool results as ``tool`` messages and its text as ``user`` messages, in order."""
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            if texts:
                turns.append({"role": "user", "content": "".join(texts)})
                texts = []
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        else:
            texts.append(block.text)
    if texts or not turns:
        turns.append({"role": "user", "content": "".join(texts)})
    return turns


def _assistant(message: AssistantMessage) -> dict[str, Any]:
    """An assistant message: its text as content, its ``tool_use`` blocks as tool calls."""
    text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input)}}
             for block in message.content if isinstance(block, ToolUseBlock)]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


def conversation(request: MessagesRequest) -> list[dict[str, Any]]:
    """The request's turns as the chat template's messages; 400 for a prefilled assistant reply."""
    if isinstance(request.messages[-1], AssistantMessage):
        raise bad_request(f"messages.{len(request.messages) - 1}: the last message is the assistant's: continuing "
                          "a prefilled reply is not supported (the chat template opens a new turn); end with a "
                          "user message", param="messages")
    system = _text(request.system or [])
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for message in request.messages:
        if isinstance(message, UserMessage):
            messages += _user(message)
        else:
            messages.append(_assistant(message))
    return messages


def _function(tool: Tool) -> dict[str, Any]:
    """A custom tool as an OpenAI function; a typed one (Anthropic's computer, bash, ...) by its name, its type
    and settings as its description, any input."""
    if tool.input_schema is not None:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        return {"type": "function", "function": {**function, "parameters": tool.input_schema}}
    settings = {k: v for k, v in (tool.model_extra or {}).items() if k not in NOT_SETTINGS}
    described = tool.description or f"Anthropic's {tool.type} tool" + (f" {json.dumps(settings)}" if settings else "")
    return {"type": "function", "function": {"name": tool.name, "description": described,
                                             "parameters": {"type": "object"}}}


class EngineRequest(ChatCompletionRequest):
    """The chat completions request a Messages call is served as; ``top_k`` goes to the engine too."""

    top_k: int | None = None

    def engine_params(self, response_length: int) -> dict[str, Any]:
        params = super().engine_params(response_length)
        if self.top_k is not None:
            params["top_k"] = self.top_k
        return params


def engine_request(request: MessagesRequest, messages: list[dict[str, Any]]) -> EngineRequest:
    """The request's sampling, tools and stream flag, as chat completions read them."""
    try:
        return EngineRequest.model_validate({
            "model": request.model, "messages": messages, "max_tokens": request.max_tokens,
            "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
            "stop": request.stop_sequences, "stream": request.stream,
            "tools": [_function(tool) for tool in request.tools] if request.tools else None})
    except ValidationError as exc:  # not expected: the Messages schema is the stricter
        raise from_validation_error(exc) from None
