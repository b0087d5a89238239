"""Tool calls in generated text (Hermes / Qwen style) parsed into OpenAI's ``tool_calls``.

The model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks; OpenAI clients expect ``message.tool_calls`` with ``arguments`` as a
JSON string. Text that does not parse stays content: a malformed call is the
model's output, not the gateway's error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]]


def parse(text: str) -> ParsedOutput:
    """Split generated text into content and tool calls."""
    if OPEN not in text:
        return ParsedOutput(text, [])
    calls = []
    for block in _BLOCK.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return ParsedOutput(text, [])
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedOutput(text, [])
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    if not calls:
        return ParsedOutput(text, [])
    content = text[:text.index(OPEN)].strip()
    return ParsedOutput(content or None, calls)


def safe_prefix(text: str) -> int:
    """How much of ``text`` can be streamed as content: up to a (possible) start of a tool call."""
    start = text.find(OPEN)
    if start >= 0:
        return start
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
