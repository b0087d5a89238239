"""slime's ``Sample``: one rollout of one prompt, and the status a rollout ends with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


@dataclass
class Sample:
    """One rollout of one prompt, as slime's ``Sample``."""

    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    prompt_uid: str | None = None
    """The group's id on the prompt ledger (and the gateway's ``prompt_uid``), when a ledger is used."""

    Status = Status

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        data = dict(data)
        data["status"] = Status(data.get("status", Status.PENDING.value))
        return cls(**data)
