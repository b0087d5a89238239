"""Request bodies of Anthropic's Messages API (``POST {base_url}/v1/messages``), validated before any handler runs.

Field names follow Anthropic's API; unknown fields (``metadata``, ``thinking``, ``cache_control`` on a
block, ...) are accepted and ignored, as the chat completions route ignores OpenAI's. Content is a
string or a list of blocks; the blocks a role may send are stated per role, so that a ``tool_use`` in a
user message or an image is a 400 naming the message and the block. The gateway's model reads text:
images and documents are refused, never dropped silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from trajbus.gateway.schemas import U32

STOP_SEQUENCES = 4
"""At most this many stop sequences: the chat completions route's rule (the same engine request)."""


def _as_blocks(value: Any) -> Any:
    """A string content is one text block (Anthropic's shorthand)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _kind(key: str):
    """A union's tag: ``key`` of the object (a dict as sent, or a model); the union's own error for any other."""
    return lambda value: value.get(key) if isinstance(value, dict) else getattr(value, key, None)


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: no bearing on the tokens
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """A tool call of an earlier assistant turn, as the gateway returned it."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


Texts = Annotated[list[TextBlock], BeforeValidator(_as_blocks, json_schema_input_type=str | list[TextBlock])]
"""A string, or text blocks (joined as they are, as the chat completions route joins text parts)."""


class ToolResultBlock(BaseModel):
    """What a tool answered: a ``tool`` message of the chat template."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Texts = Field(default_factory=list)
    is_error: bool = False


UserBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolResultBlock, Tag("tool_result")],
    Discriminator(_kind("type"), custom_error_type="content_block",
                  custom_error_message="a user message's content blocks are objects of type 'text' or "
                                       "'tool_result' (no images or documents: the model reads text)")]
AssistantBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")],
    Discriminator(_kind("type"), custom_error_type="content_block",
                  custom_error_message="an assistant message's content blocks are objects of type 'text' or "
                                       "'tool_use'")]


class UserMessage(BaseModel):
    role: Literal["user"]
    content: Annotated[list[UserBlock], BeforeValidator(_as_blocks, json_schema_input_type=str | list[UserBlock])]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Annotated[list[AssistantBlock],
                       BeforeValidator(_as_blocks, json_schema_input_type=str | list[AssistantBlock])]


InputMessage = Annotated[
    Annotated[UserMessage, Tag("user")] | Annotated[AssistantMessage, Tag("assistant")],
    Discriminator(_kind("role"), custom_error_type="role",
                  custom_error_message="role: 'user' or 'assistant' (the system prompt is the top-level 'system' "
                                       "field)")]

CLIENT_TOOL = {"anyOf": [
    {"required": ["input_schema"], "properties": {"input_schema": {"type": "object"}}},
    {"required": ["type"], "properties": {"type": {"type": "string", "not": {"const": "custom"}}}}]}
"""A custom tool has an ``input_schema``; a tool of Anthropic's own types (``bash_...``, ``computer_...``) a
``type`` (``Tool._schema_present``)."""


class Tool(BaseModel):
    """A custom tool (``name``, ``description``, ``input_schema``), or one of Anthropic's typed client tools
    (``{"type": "computer_20250124", "name": "computer", ...}``): offered to the model by name, any input."""

    model_config = ConfigDict(extra="allow", json_schema_extra=CLIENT_TOOL)
    name: str = Field(min_length=1, max_length=128)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> "Tool":
        if self.input_schema is None and self.type in (None, "custom"):
            raise ValueError(f"tool {self.name!r}: a custom tool needs input_schema")
        return self


class MessagesRequest(BaseModel):
    """``POST /v1/messages``: Anthropic's fields; ``top_k`` goes to the engine (vLLM's), ``tool_choice`` is
    accepted and ignored (as ``tool_choice`` of chat completions)."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int = Field(ge=1, lt=U32)
    messages: list[InputMessage] = Field(..., min_length=1)
    system: Texts | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, lt=U32)
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
