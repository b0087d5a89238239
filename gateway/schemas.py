"""Request bodies of the gateway, validated by FastAPI before any handler runs.

Field names follow OpenAI's chat completions API (plus vLLM's ``ignore_eos``);
unknown OpenAI fields are accepted and ignored, so any client library works.
A wrong type, an empty ``messages``, an unknown role or a negative
``max_tokens`` is refused with a 400 naming the field.

Every integer is bounded here by the width it has in storage or on the wire
(SQLite INTEGER is 64-bit; the codec packs step_index and n_rollouts as u32,
policy_version as i64, token ids in at most 32 bits), so a number past it is a
400 naming the field, never an overflow inside SQLite or Kafka (a 500), and the
OpenAPI schema says what the routes accept.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WithJsonSchema, field_validator, model_validator

from trajbus.gateway.errors import bad_request
from trajbus.streams.wire.records import CREATED_AT_LIMIT, Step

Role = Literal["system", "developer", "user", "assistant", "tool"]

U32 = 2**32
I64 = 2**63
CHANNEL_PATTERN = r"^[a-z0-9_-]{1,64}$"
"""``streams.wire.topics.validate_channel``'s rule: a channel becomes part of topic names."""

TokenId = Annotated[int, Field(ge=0, lt=U32)]
StepIndex = Annotated[int, Field(ge=0, lt=U32, description="packed as u32 on the wire")]
NRollouts = Annotated[int, Field(ge=1, lt=U32, description="the prompt group's size (u32 on the wire)")]
PolicyVersion = Annotated[int, Field(ge=-I64, lt=I64, description="i64 on the wire and in SQLite")]
Channel = Annotated[str, Field(pattern=CHANNEL_PATTERN, description="names topics: [a-z0-9_-]{1,64}")]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


TextParts = Annotated[list[dict[str, Any]], WithJsonSchema({
    "type": "array", "description": "text parts only (no images or audio)", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}})]
"""A multi-part content, checked by ``ChatMessage`` (a refused part is named by its type)."""


HAS_CONTENT = {"anyOf": [
    {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
    {"required": ["role", "tool_calls"],
     "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}}]}
"""A message has content, unless it is an assistant's with tool calls (``ChatMessage._content_present``)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=HAS_CONTENT)
    role: Role
    content: str | TextParts | None = None
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
    max_tokens: int | None = Field(None, ge=1, lt=U32)
    max_completion_tokens: int | None = Field(None, ge=1, lt=U32)
    stop: Annotated[str | list[str] | None, WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4}, {"type": "null"}]})] = None
    seed: int | None = Field(None, ge=0, lt=I64, description="an engine's generator takes a signed 64-bit seed")
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
    prompt_ids: list[TokenId] = Field(..., min_length=1)
    trajectory_uid: str | None = Field(None, min_length=1, description="keeps calls of one trajectory on one backend; "
                                                         "its first call is admitted when pacing is on")
    prompt_uid: str | None = Field(None, min_length=1, max_length=256,
                                   description="the trajectory's prompt group; required with a trajectory_uid "
                                               "when pacing admits it (its first call)")
    channel: Channel | None = None
    policy_version: PolicyVersion | None = Field(None, description="the version the trajectory starts at "
                                                                   "(for admission)")
    step_index: StepIndex | None = Field(None, description="above 0: a trajectory already under way, never held")


class StepBody(BaseModel):
    """A ``streams.wire.records.Step`` as JSON: the OpenAPI schema of ``/submit_steps``'s steps.

    Documentation only: the route checks steps with ``Step.from_dict``, the producer's own rule, which
    checks token lists at C speed where a model would build a Python object per token.
    """

    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[TokenId]
    response_ids: list[TokenId]
    trajectory_uid: str = Field(min_length=1)
    prompt_uid: str = Field(min_length=1)
    step_index: StepIndex = 0
    reward: float = Field(0.0, allow_inf_nan=False)
    policy_version: PolicyVersion = 0
    is_last: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)
    rollout_log_probs: list[float] | None = Field(None, description="one per response token")
    created_at: float = Field(default_factory=time.time, ge=0, lt=CREATED_AT_LIMIT,
                              description="Unix time in seconds: the record's timestamp")
    channel: Channel | None = Field(None, description="when given, the channel of the request")
    n_rollouts: NRollouts | None = None
    version_segments: list[tuple[StepIndex, PolicyVersion]] | None = Field(
        None, min_length=1, description="[[start, version], ...]: where each run of response tokens one policy "
                                        "version sampled begins (a generation a weight update cut); null: all "
                                        "policy_version's")


class SubmitStepsRequest(BaseModel):
    """``/submit_steps``'s body when it names the group size; each step is checked by ``Step.from_dict``."""

    model_config = ConfigDict(extra="forbid")
    steps: list[dict[str, Any]] = Field(..., min_length=1)
    n_rollouts: NRollouts | None = None


def _integral(value: Any) -> Any:
    return int(value) if type(value) is float and value.is_integer() else value


def step_from_json(data: Any) -> Step:
    """``Step.from_dict``, where JSON's ``3.0`` is the integer 3 (JSON Schema's rule, and the other
    routes' through pydantic); the conversion runs only for a step the strict check refused. Every other
    rule (``created_at`` fits the record's timestamp, strings are valid Unicode) is ``Step.validate``'s,
    the Python API's own."""
    try:
        return Step.from_dict(data)
    except ValueError:
        if not isinstance(data, dict):
            raise
        fixed = {**data}
        for name in ("step_index", "policy_version", "n_rollouts"):
            if name in fixed:
                fixed[name] = _integral(fixed[name])
        for name in ("prompt_ids", "response_ids"):
            if isinstance(fixed.get(name), list):
                fixed[name] = [_integral(token) for token in fixed[name]]
        return Step.from_dict(fixed)


def submit_steps_schema() -> dict[str, Any]:
    """The body ``/submit_steps`` takes, for the OpenAPI schema: steps, bare or with the group size."""
    steps = {"type": "array", "items": StepBody.model_json_schema(), "minItems": 1}
    wrapped = {"type": "object", "additionalProperties": False, "required": ["steps"], "title": "SubmitSteps",
               "properties": {"steps": steps, "n_rollouts": TypeAdapter(NRollouts | None).json_schema()}}
    return {"anyOf": [wrapped, steps]}


class RewardRequest(BaseModel):
    """What a reward function receives (``gateway.state.lifecycle.reward_input``'s shape, each key present);
    other keys pass through to it."""

    model_config = ConfigDict(extra="allow")
    trajectory_uid: str | None = None
    prompt_uid: str | None = None
    channel: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    response_text: str = ""


class TrajectoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    channel: Channel | None = None
    n_rollouts: NRollouts | None = None
    metadata: dict[str, Any] | None = None
    policy_version: PolicyVersion | None = Field(None, description="the version the agent's engine serves; default: "
                                                         "the policy topic's")


class InitTrajectoryRequest(TrajectoryOptions):
    # Required (the schema says so), checked by the route so that its 400 says why (lifecycle.PROMPT_UID_REQUIRED).
    model_config = ConfigDict(extra="forbid", json_schema_extra={"required": ["prompt_uid"]})
    prompt_uid: str | None = Field(None, min_length=1, max_length=256,
                                   description="the id of the prompt this rollout answers: the rollouts of one "
                                               "prompt share it, and the worker groups them by it")


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


class PauseRequest(BaseModel):
    """``/admin/pause``: cut the generations in flight (default), or ``drain``: let them end first."""

    model_config = ConfigDict(extra="forbid")
    drain: bool = Field(False, description="hold new calls until the generations in flight end, cutting none")


class ResumeRequest(BaseModel):
    """``/admin/resume``: the version the engines serve from now on (not older than the one served)."""

    model_config = ConfigDict(extra="forbid")
    version: PolicyVersion
