"""slime's ``Sample``: one rollout of one prompt, and the status a rollout ends with.

The fields have slime's names (``slime.utils.types.Sample``), and ``Sample.Status`` its values, so
code written for slime's ``Sample`` reads and writes this one unchanged. trajbus adds two fields:
``tools`` (the prompt's tool schemas; slime keeps them in ``metadata["tools"]``) and ``prompt_uid``
(the group's id on the prompt ledger and the gateway). Where slime itself is installed, a data source
for slime hands out slime's own class instead (``consumers.slime.sample_kind``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"
    """A recoverable failure (a tool or API error): the sample may hold partial output."""


@dataclass
class SpecInfo:
    """Speculative-decoding counters, as slime's ``Sample.SpecInfo``."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class PrefixCacheInfo:
    """Prefix-cache counters, as slime's ``Sample.PrefixCacheInfo``."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class Sample:
    """One rollout of one prompt, with slime's fields."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    """Shared by the training samples one rollout was split into (slime's compact rollouts); None: ``index``."""
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
    tools: list[dict[str, Any]] | None = None
    prompt_uid: str | None = None
    """The group's id on the prompt ledger (and the gateway's ``prompt_uid``), when a ledger is used."""

    Status = Status
    SpecInfo = SpecInfo
    PrefixCacheInfo = PrefixCacheInfo

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        """A sample from ``to_dict`` (or slime's ``Sample.to_dict``); keys of no field are left out."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        values["status"] = Status(values.get("status", Status.PENDING.value))
        values["spec_info"] = SpecInfo(**(values.get("spec_info") or {}))
        values["prefix_cache_info"] = PrefixCacheInfo(**(values.get("prefix_cache_info") or {}))
        return cls(**values)

    def get_reward_value(self, args: Any) -> Any:
        """The reward, or its ``args.reward_key`` entry when the reward is a dict (slime's rule)."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length
