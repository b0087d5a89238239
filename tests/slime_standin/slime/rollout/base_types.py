"""A stand-in for slime's ``slime.rollout.base_types``: the two outputs a rollout function returns, written for
trajbus's tests from their field names (``samples``/``data`` and ``metrics``). No code of slime's is in it."""

from dataclasses import dataclass
from typing import Any


@dataclass
class RolloutFnTrainOutput:
    samples: list
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict
    metrics: dict[str, Any] | None = None
