"""Cumulative token capture: the next prompt of a conversation is its previous prompt, the
tokens sampled for it, and only the new messages' part of the chat template.

Rendering the whole conversation again at every call re-encodes earlier replies
from their text. BPE has many encodings of one string, engines sample
non-canonical ones all the time, and reasoning templates drop earlier
``<think>`` blocks from history: the re-rendered prompt then holds tokens that
were never sampled, and a multi-turn trajectory is no longer one sequence. So
when a request's messages extend the conversation the gateway already holds
(the same messages, the assistant turns as the gateway returned them), the
prompt is ``context_ids`` (the last prompt + its sampled response) followed by
the template text of the new messages, found by rendering them after a
stand-in assistant turn. Otherwise the whole conversation is rendered and the
step starts a new segment. Only the new messages are rendered: the cost of a
call does not grow with the conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import orjson

from trajbus.gateway.prompts.encoder_thread import inline
from trajbus.gateway.prompts.token_ids import TokenIds, packed
from trajbus.streams.wire.token_prefix import begins_with

CUMULATIVE, RENDER = "cumulative", "render"
MULTI_TURN_MODES = (CUMULATIVE, RENDER)

_MARK = "\ue000trajbus-assistant\ue000"  # content of the stand-in assistant turn (private-use characters)
CLOSINGS_KEPT = 64
_STAND_IN = [{"role": "user", "content": "\ue001"}, {"role": "assistant", "content": _MARK}]


@dataclass(frozen=True)
class Prompt:
    ids: TokenIds
    new_segment: bool
    """True when the trajectory has a previous context and this prompt does not extend it."""


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _normal(message: dict[str, Any]) -> tuple:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        calls.append((function.get("name"), _arguments(function.get("arguments"))))
    return (message.get("role"), message.get("content") or "", calls, message.get("name"),
            message.get("tool_call_id"))


def extends(messages: list[dict[str, Any]], conversation: list[dict[str, Any]] | None) -> bool:
    """Whether ``messages`` start with ``conversation`` (content and tool calls, arguments as JSON)."""
    if not conversation or len(messages) < len(conversation):
        return False
    if messages[:len(conversation)] == conversation:  # as sent back (the usual case): compared at C speed
        return True
    return all(_normal(a) == _normal(b) for a, b in zip(messages, conversation))


def _overlap(context_ids: TokenIds, closing_ids: TokenIds) -> int:
    """How many of the template's end-of-turn ids the sampled response already ends with."""
    for k in range(min(len(closing_ids), len(context_ids)), 0, -1):
        if context_ids[-k:] == closing_ids[:k]:
            return k
    return 0


class PromptBuilder:
    """Prompt ids of one call from the messages and the trajectory's token state."""

    def __init__(self, tokenizer: Any, mode: str = CUMULATIVE, run: Callable[..., Any] = inline) -> None:
        """``run``: how an encode is run (``EncoderThread.run``: on a thread of its own; else on the caller's)."""
        if mode not in MULTI_TURN_MODES:
            raise ValueError(f"multi_turn: must be one of {MULTI_TURN_MODES}, got {mode!r}")
        self.tokenizer, self.mode, self.run = tokenizer, mode, run
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        """A fast tokenizer's own encoder (Hugging Face ``tokenizers``), called directly: the same ids as
        ``tokenizer.encode``, without the batch wrapping transformers adds at every call."""
        self._closings: dict[bytes, tuple[str, TokenIds] | None] = {}
        """Per tool list: what the template writes after an assistant turn, as text and ids (None: no mark)."""

    def _text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> TokenIds:
        return self.run(self._encode_here, text)

    def _encode_here(self, text: str) -> TokenIds:
        if self._backend is not None:
            return packed(self._backend.encode(text, add_special_tokens=False).ids)
        return packed(self.tokenizer.encode(text, add_special_tokens=False))

    def _closing(self, tools: list[dict[str, Any]] | None) -> tuple[str, TokenIds] | None:
        """The end of an assistant turn under these tools (the same for every call that offers them)."""
        key = orjson.dumps(tools or None, option=orjson.OPT_SORT_KEYS)
        if key not in self._closings:
            closed = self._text(_STAND_IN, tools, False)
            closing = closed[closed.index(_MARK) + len(_MARK):] if _MARK in closed else None
            if len(self._closings) >= CLOSINGS_KEPT:
                self._closings.clear()
            self._closings[key] = None if closing is None else (closing, self._encode(closing))
        return self._closings[key]

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> TokenIds:
        """The whole conversation's chat template, generation prompt included."""
        return self._encode(self._text(messages, tools, True))

    def continuation(self, context_ids: TokenIds, new_messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None) -> TokenIds | None:
        """``context_ids`` + the template of ``new_messages`` after an assistant turn; None if the
        template does not separate them (then the caller renders the whole conversation)."""
        try:
            known = self._closing(tools)
            text = self._text(_STAND_IN + new_messages, tools, True)
        except Exception:  # a template that refuses the stand-in: render the whole conversation
            return None
        if known is None or _MARK not in text:
            return None
        closing, closing_ids = known  # what the template writes after a reply
        tail = text[text.index(_MARK) + len(_MARK):]
        if not tail.startswith(closing):
            return None
        tail_ids = self._encode(tail)
        if tail_ids[:len(closing_ids)] != closing_ids:  # BPE merged across the end of the turn
            return None
        return context_ids + tail_ids[_overlap(context_ids, closing_ids):]

    def new_messages(self, messages: list[dict[str, Any]], conversation: list[dict[str, Any]] | None,
                     context_ids: TokenIds | None) -> list[dict[str, Any]] | None:
        """What ``messages`` add to the conversation whose token state is ``context_ids``; None when the call
        does not continue it (or in render mode): then the whole conversation is rendered."""
        if self.mode == CUMULATIVE and context_ids and extends(messages, conversation):
            return messages[len(conversation):]
        return None

    def build(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              conversation: list[dict[str, Any]] | None, context_ids: TokenIds | None) -> Prompt:
        """The prompt of a call whose trajectory last saw ``conversation`` with ``context_ids``.

        Raises what the chat template raises for a conversation it cannot render.
        """
        return self.build_new(messages, tools, self.new_messages(messages, conversation, context_ids), context_ids)

    def build_new(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  new: list[dict[str, Any]] | None, context_ids: TokenIds | None) -> Prompt:
        """``build``, given what ``new_messages`` found (a caller that sizes the work first asks once)."""
        if new is not None:
            ids = self.continuation(context_ids, new, tools)
            if ids is not None:
                return Prompt(ids, False)
        ids = self.render(messages, tools)
        return Prompt(ids, bool(context_ids) and not begins_with(ids, context_ids))
