"""Off-policy bookkeeping: which policy a row came from, and how to correct for it.

Rows carry ``policy_version`` (the oldest of their steps) and, given the
trainer's current version, ``staleness``; tokens carry ``token_policy_version``
(the version that sampled each one: a generation a weight update cut and
continued holds two) and ``token_staleness``. ``importance_weights`` turns the
engine's ``rollout_log_probs`` and the trainer's own log-probs into truncated
importance weights and a mask of the tokens to keep, at token, segment (one
ratio per run of tokens one version sampled) or sequence level, in the shape
verl's rollout correction takes (``rollout_is_weights``). Each token's rollout
log-prob is the one the version that sampled it reported, so token-level
weights are per token consistent with its version as they are; with
``max_staleness``, tokens sampled more than that many versions ago are masked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajbus.streams.client.policy import PolicyVersionPublisher

if TYPE_CHECKING:
    import torch

__all__ = ["PolicyVersionPublisher", "importance_weights", "staleness"]

LEVELS = ("token", "segment", "sequence")


def staleness(policy_versions, current_version: int):
    """Per row or per token: how many versions the trainer is ahead of the policy that produced it."""
    return current_version - policy_versions


def _per_segment(delta: "torch.Tensor", token_versions: "torch.Tensor") -> "torch.Tensor":
    """Each token's run (a row's consecutive tokens of one version): the sum of ``delta`` over its run."""
    import torch

    changes = torch.zeros_like(token_versions, dtype=torch.long)
    changes[:, 1:] = (token_versions[:, 1:] != token_versions[:, :-1]).long()
    runs = changes.cumsum(dim=-1)
    sums = torch.zeros_like(delta).scatter_add_(-1, runs, delta)
    return sums.gather(-1, runs)


def importance_weights(rollout_log_probs: "torch.Tensor", log_probs: "torch.Tensor", response_mask: "torch.Tensor",
                       cap: float = 2.0, level: str = "token", token_versions: "torch.Tensor | None" = None,
                       current_version: int | None = None, max_staleness: int | None = None,
                       ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Truncated importance weights ``min(pi/pi_rollout, cap)`` and the mask of tokens whose
    ratio stays within ``[1/cap, cap]``; both zero outside ``response_mask``.

    ``level="sequence"`` uses one ratio per row, ``exp(sum(log_probs - rollout_log_probs))``
    over its response tokens, broadcast to them; ``level="segment"`` one per run of tokens
    of one version (``token_versions``, the batch's ``token_policy_version``). With
    ``max_staleness`` (and ``token_versions``, ``current_version``), tokens more than that
    many versions behind are neither kept nor weighted.
    """
    import torch

    if level not in LEVELS:
        raise ValueError(f"level: must be one of {LEVELS}, got {level!r}")
    if cap <= 1.0:
        raise ValueError(f"cap: must be above 1, got {cap}")
    if rollout_log_probs.shape != log_probs.shape or log_probs.shape != response_mask.shape:
        raise ValueError(f"shapes differ: rollout_log_probs {tuple(rollout_log_probs.shape)}, "
                         f"log_probs {tuple(log_probs.shape)}, response_mask {tuple(response_mask.shape)}")
    if (level == "segment" or max_staleness is not None) and (
            token_versions is None or token_versions.shape != log_probs.shape):
        raise ValueError("token_versions: needed, in the shape of log_probs, for level='segment' or max_staleness")
    mask = response_mask.bool()
    if max_staleness is not None:
        if current_version is None:
            raise ValueError("current_version: needed with max_staleness")
        mask = mask & (staleness(token_versions, current_version) <= max_staleness)
    delta = (log_probs - rollout_log_probs).masked_fill(~mask, 0.0)
    if level == "sequence":
        delta = delta.sum(dim=-1, keepdim=True).expand_as(delta)
    elif level == "segment":
        delta = _per_segment(delta, token_versions)
    ratio = torch.exp(delta)
    weights = ratio.clamp(max=cap).masked_fill(~mask, 0.0).to(torch.float32)
    keep = mask & (ratio <= cap) & (ratio >= 1.0 / cap)
    return weights, keep
