"""Off-policy bookkeeping: which policy a row came from, and how to correct for it.

Rows carry ``policy_version`` (the oldest of their steps) and, given the
trainer's current version, ``staleness``. ``importance_weights`` turns the
engine's ``rollout_log_probs`` and the trainer's own log-probs into truncated
importance weights and a mask of the tokens to keep, at token or sequence level,
in the shape verl's rollout correction takes (``rollout_is_weights``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajbus.streams.policy import PolicyVersionPublisher

if TYPE_CHECKING:
    import torch

__all__ = ["PolicyVersionPublisher", "importance_weights", "staleness"]

LEVELS = ("token", "sequence")


def staleness(policy_versions, current_version: int):
    """Per row: how many versions the trainer is ahead of the policy that produced it."""
    return current_version - policy_versions


def importance_weights(rollout_log_probs: "torch.Tensor", log_probs: "torch.Tensor", response_mask: "torch.Tensor",
                       cap: float = 2.0, level: str = "token") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Truncated importance weights ``min(pi/pi_rollout, cap)`` and the mask of tokens whose
    ratio stays within ``[1/cap, cap]``; both zero outside ``response_mask``.

    ``level="sequence"`` uses one ratio per row, ``exp(sum(log_probs - rollout_log_probs))``
    over its response tokens, broadcast to them.
    """
    import torch

    if level not in LEVELS:
        raise ValueError(f"level: must be one of {LEVELS}, got {level!r}")
    if cap <= 1.0:
        raise ValueError(f"cap: must be above 1, got {cap}")
    if rollout_log_probs.shape != log_probs.shape or log_probs.shape != response_mask.shape:
        raise ValueError(f"shapes differ: rollout_log_probs {tuple(rollout_log_probs.shape)}, "
                         f"log_probs {tuple(log_probs.shape)}, response_mask {tuple(response_mask.shape)}")
    mask = response_mask.bool()
    delta = (log_probs - rollout_log_probs).masked_fill(~mask, 0.0)
    if level == "sequence":
        delta = delta.sum(dim=-1, keepdim=True).expand_as(delta)
    ratio = torch.exp(delta)
    weights = ratio.clamp(max=cap).masked_fill(~mask, 0.0).to(torch.float32)
    keep = mask & (ratio <= cap) & (ratio >= 1.0 / cap)
    return weights, keep
