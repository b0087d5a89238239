"""Training backends: the steps of ready groups as the tensors a trainer consumes.

``VerlBackend`` returns verl's own ``DataProto`` laid out as verl's agent loop
lays it out: ``prompts`` left-padded to ``prompt_length``, ``responses``
right-padded to ``response_length``, ``input_ids`` their concatenation,
``attention_mask``, ``response_mask``, ``position_ids`` from the mask,
``rm_scores`` with each row's reward on its last real response token, and
``rollout_log_probs`` when every step has them.

Two row modes:
- ``step``: one row per step (per LLM call);
- ``trajectory``: one row per trajectory segment. Each step's prompt must
  extend the prompt and response of the step it continues (the previous one,
  or the index its ``continues`` metadata names); the tokens between two model
  outputs (tool results, the next user turn) join the response with
  ``response_mask`` 0, so a multi-turn agent trains one row instead of one per
  turn. A step marked ``segment_start`` (history edited by the agent, an extra
  choice of an ``n > 1`` call) begins a row of its own; every row of a
  trajectory carries the trajectory's reward.

Every row is checked before any tensor is built; a bad step is a ``ValueError``
that names it, never a silent cut.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trajbus.consumers.off_policy import staleness
from trajbus.streams.records import CONTINUES, SEGMENT_START, Step

if TYPE_CHECKING:  # verl is imported when a batch is built, not when trajbus is
    from verl import DataProto

ROW_MODES = ("step", "trajectory")


def _name(step: Step) -> str:
    return f"step {step.trajectory_uid}#{step.step_index}"


def check_group(steps: list[Step]) -> list[Step]:
    """One prompt group: every step shares the first step's prompt_uid (GRPO groups by it)."""
    for step in steps:
        if step.prompt_uid != steps[0].prompt_uid:
            raise ValueError(f"{_name(step)}: prompt_uid {step.prompt_uid!r} differs from its group's "
                             f"{steps[0].prompt_uid!r}")
    return steps


@dataclass
class Row:
    """One training row before padding."""

    prompt: list[int]
    response: list[int]
    response_mask: list[int]
    log_probs: list[float] | None
    reward: float
    steps: list[Step]


def _segment_row(segment: list[Step], reward: float) -> Row:
    """One row of steps whose prompts each extend the previous step's prompt and response."""
    first = segment[0]
    context = list(first.prompt_ids)
    response: list[int] = []
    mask: list[int] = []
    log_probs: list[float] | None = [] if all(s.rollout_log_probs is not None for s in segment) else None
    for step in segment:
        if step.prompt_ids[:len(context)] != context:
            raise ValueError(f"{_name(step)}: its prompt does not extend the prompt and response of the step "
                             f"it continues; use row_mode='step' for this trajectory")
        between = step.prompt_ids[len(context):]
        response += between + step.response_ids
        mask += [0] * len(between) + [1] * len(step.response_ids)
        if log_probs is not None:
            log_probs += [0.0] * len(between) + list(step.rollout_log_probs)
        context = list(step.prompt_ids) + list(step.response_ids)
    return Row(list(first.prompt_ids), response, mask, log_probs, reward, segment)


class TrainingBackend(ABC):
    """Turns the steps of ready groups into one training batch."""

    @abstractmethod
    def convert(self, steps: list[Step], current_version: int | None = None) -> Any:
        """One batch of ``steps``; with ``current_version``, rows carry their staleness."""


class VerlBackend(TrainingBackend):
    """Steps -> ``verl.DataProto`` (see the module docstring for the layout)."""

    def __init__(self, prompt_length: int, response_length: int, pad_token_id: int = 0,
                 row_mode: str = "step", temperature: float = 1.0) -> None:
        if prompt_length < 1 or response_length < 1:
            raise ValueError("prompt_length and response_length must be positive")
        if row_mode not in ROW_MODES:
            raise ValueError(f"row_mode: must be one of {ROW_MODES}, got {row_mode!r}")
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.pad_token_id = pad_token_id
        self.row_mode = row_mode
        self.temperature = temperature

    # -- rows ------------------------------------------------------------------------
    def rows(self, steps: list[Step]) -> list[Row]:
        if not steps:
            raise ValueError("steps: an empty batch cannot be converted")
        for step in steps:
            if step.rollout_log_probs is not None and len(step.rollout_log_probs) != len(step.response_ids):
                raise ValueError(f"{_name(step)}: {len(step.rollout_log_probs)} log-probs for "
                                 f"{len(step.response_ids)} response tokens")
        if self.row_mode == "step":
            rows = [Row(s.prompt_ids, s.response_ids, [1] * len(s.response_ids), s.rollout_log_probs, s.reward, [s])
                    for s in steps]
        else:
            rows = self._trajectory_rows(steps)
        for row in rows:
            last = row.steps[-1]
            if len(row.prompt) > self.prompt_length:
                raise ValueError(f"{_name(row.steps[0])}: prompt of {len(row.prompt)} tokens exceeds "
                                 f"prompt_length {self.prompt_length}")
            if len(row.response) > self.response_length:
                raise ValueError(f"{_name(last)}: response of {len(row.response)} tokens exceeds "
                                 f"response_length {self.response_length}")
        return rows

    def _trajectory_rows(self, steps: list[Step]) -> list[Row]:
        by_trajectory: dict[str, list[Step]] = {}
        for step in steps:
            by_trajectory.setdefault(step.trajectory_uid, []).append(step)
        rows = []
        for trajectory in by_trajectory.values():
            check_group(trajectory)
            trajectory.sort(key=lambda s: s.step_index)
            reward = trajectory[-1].reward
            segments: list[list[Step]] = []
            tips: dict[int, list[Step]] = {}  # step_index of a segment's last step -> the segment
            for previous, step in zip([None, *trajectory], trajectory):
                if previous is None or step.metadata.get(SEGMENT_START):
                    segment = [step]
                    segments.append(segment)
                else:
                    segment = tips.pop(step.metadata.get(CONTINUES, previous.step_index), None)
                    if segment is None:
                        raise ValueError(f"{_name(step)}: the step it continues is not in the batch; "
                                         f"use row_mode='step' for this trajectory")
                    segment.append(step)
                tips[step.step_index] = segment
            rows += [_segment_row(segment, reward) for segment in segments]
        return rows

    # -- tensors ---------------------------------------------------------------------
    def convert(self, steps: list[Step], current_version: int | None = None) -> DataProto:
        import torch  # with verl: only where batches are built, not wherever trajbus is imported
        from verl import DataProto

        rows = self.rows(steps)
        n, p_len, r_len = len(rows), self.prompt_length, self.response_length
        prompts = np.full((n, p_len), self.pad_token_id, dtype=np.int64)
        responses = np.full((n, r_len), self.pad_token_id, dtype=np.int64)
        prompt_mask = np.zeros((n, p_len), dtype=np.int64)
        response_attention = np.zeros((n, r_len), dtype=np.int64)
        response_mask = np.zeros((n, r_len), dtype=np.int64)
        scores = np.zeros((n, r_len), dtype=np.float32)
        with_log_probs = all(row.log_probs is not None for row in rows)
        log_probs = np.zeros((n, r_len), dtype=np.float32)
        for i, row in enumerate(rows):  # slice assignments; the arrays are allocated once
            p, r = len(row.prompt), len(row.response)
            prompts[i, p_len - p:] = row.prompt
            prompt_mask[i, p_len - p:] = 1
            responses[i, :r] = row.response
            response_attention[i, :r] = 1
            response_mask[i, :r] = row.response_mask
            last_real = max((j for j, m in enumerate(row.response_mask) if m), default=r - 1)
            if last_real >= 0:
                scores[i, last_real] = row.reward
            if with_log_probs:
                log_probs[i, :r] = row.log_probs
        attention = np.concatenate([prompt_mask, response_attention], axis=1)
        position_ids = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
        tensors = {
            "prompts": torch.from_numpy(prompts),
            "responses": torch.from_numpy(responses),
            "input_ids": torch.from_numpy(np.concatenate([prompts, responses], axis=1)),
            "attention_mask": torch.from_numpy(attention),
            "response_mask": torch.from_numpy(response_mask),
            "position_ids": torch.from_numpy(position_ids),
            "rm_scores": torch.from_numpy(scores),
        }
        if with_log_probs:
            tensors["rollout_log_probs"] = torch.from_numpy(log_probs)
        non_tensors = {
            "uid": np.array([row.steps[0].prompt_uid for row in rows], dtype=object),  # what GRPO groups by
            "trajectory_uid": np.array([row.steps[0].trajectory_uid for row in rows], dtype=object),
            "step_index": np.array([row.steps[-1].step_index for row in rows], dtype=np.int64),
            "policy_version": np.array([min(s.policy_version for s in row.steps) for row in rows], dtype=np.int64),
        }
        if current_version is not None:
            non_tensors["staleness"] = staleness(non_tensors["policy_version"], current_version)
        for key in sorted({k for row in rows for k in row.steps[-1].metadata} - set(non_tensors)):
            non_tensors[key] = np.array([row.steps[-1].metadata.get(key) for row in rows], dtype=object)
        meta_info = {"temperature": self.temperature, "row_mode": self.row_mode,
                     "current_policy_version": current_version,
                     "num_tokens": int(attention.sum()), "num_response_tokens": int(response_mask.sum())}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)
