"""Request bodies of the gateway, validated by FastAPI before any handler runs.

Field names follow OpenAI's chat completions API (plus vLLM's ``ignore_eos``);
unknown OpenAI fields are accepted and ignored, so any client library works.
A wrong type, an empty ``messages``, an unknown role or a negative
``max_tokens`` is refused with a 400 naming the field.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trajbus.gateway.errors import bad_request

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        for part in self.content if isinstance(self.content, list) else []:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only)")
        return self

    def text(self) -> str | None:
        """Content as one string: text parts of a multi-part content are joined."""
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class SamplingFields(BaseModel):
    """What a caller may ask of the engine; None means the gateway's default."""

    model_config = ConfigDict(extra="allow")
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or not all(stops):
            raise ValueError("at most 4 non-empty stop strings")
        return stops

    def engine_params(self, response_length: int) -> dict[str, Any]:
        """Sampling fields for the engine; ``max_tokens`` defaults to, and may not exceed, --response-length."""
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if requested is not None and requested > response_length:
            raise bad_request(f"max_tokens: {requested} exceeds this gateway's response length of "
                              f"{response_length} tokens", param="max_tokens")
        return {"max_tokens": requested or response_length, "n": self.n, "temperature": self.temperature,
                "top_p": self.top_p, "stop": self.stop, "seed": self.seed,
                "ignore_eos": self.ignore_eos or None}


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in tools or []:
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str):
                raise ValueError("each tool is {'type': 'function', 'function': {'name': ..., ...}}")
        return tools


class GenerateRequest(SamplingFields):
    prompt_ids: list[int] = Field(..., min_length=1)
    trajectory_uid: str | None = Field(None, description="keeps calls of one trajectory on one backend; "
                                                         "its first call is admitted when pacing is on")
    prompt_uid: str | None = Field(None, min_length=1, max_length=256,
                                   description="the trajectory's prompt group (for admission)")
    channel: str | None = None
    policy_version: int | None = Field(None, description="the version the trajectory starts at (for admission)")
    step_index: int | None = Field(None, ge=0, description="above 0: a trajectory already under way, never held")

    @field_validator("prompt_ids")
    @classmethod
    def _ids(cls, ids: list[int]) -> list[int]:
        if any(t < 0 for t in ids):
            raise ValueError("token ids are non-negative integers")
        return ids


class SubmitStepsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: list[dict[str, Any]] = Field(..., min_length=1)
    n_rollouts: int | None = Field(None, ge=1)


class TrajectoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    channel: str | None = None
    n_rollouts: int | None = Field(None, ge=1)
    metadata: dict[str, Any] | None = None
    policy_version: int | None = Field(None, description="the version the agent's engine serves; default: "
                                                         "the policy topic's")


class InitTrajectoryRequest(TrajectoryOptions):
    prompt_uid: str | None = Field(None, min_length=1, max_length=256)


class RegisterTrajectoryRequest(TrajectoryOptions):
    pass


class CompleteTrajectoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("reward")
    @classmethod
    def _finite(cls, reward: float | None) -> float | None:
        if reward is not None and not math.isfinite(reward):
            raise ValueError("reward must be a finite number")
        return reward
