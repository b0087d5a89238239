"""Training backends: the steps of ready groups as the tensors a trainer consumes.

``VerlBackend`` returns verl's own ``DataProto`` laid out as verl's agent loop
lays it out: ``prompts`` left-padded to ``prompt_length``, ``responses``
right-padded to ``response_length``, ``input_ids`` their concatenation,
``attention_mask``, ``response_mask``, ``position_ids`` from the mask,
``rm_scores`` with each row's reward on its last real response token,
``rollout_log_probs`` when every step has them, and ``token_policy_version``: the
policy version that sampled each response token (a generation a weight update cut
and continued holds two; padding takes the row's oldest), with ``token_staleness``
(0 outside ``response_mask``) when the current version is given.

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
from typing import TYPE_CHECKING, Any

import numpy as np

from trajbus.consumers.off_policy import staleness
from trajbus.consumers.rows import Row, check_group, name, step_rows, structured_rows, trajectory_rows
from trajbus.streams.wire.prefix import StructuredGroup
from trajbus.streams.wire.records import Step

if TYPE_CHECKING:  # verl is imported when a batch is built, not when trajbus is
    from verl import DataProto

ROW_MODES = ("step", "trajectory")


class TrainingBackend(ABC):
    """Turns the steps of ready groups into one training batch."""

    @abstractmethod
    def convert(self, steps: list[Step], current_version: int | None = None) -> Any:
        """One batch of ``steps``; with ``current_version``, rows carry their staleness."""

    def convert_groups(self, groups: list[StructuredGroup], current_version: int | None = None) -> Any:
        """One batch of decoded group records; a backend that reads their prefix structure overrides it."""
        return self.convert([step for group in groups for step in check_group(group.ready().steps)], current_version)


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
        self._check_log_probs(steps)
        return self._fit(step_rows(steps) if self.row_mode == "step" else trajectory_rows(steps))

    def structured_rows(self, groups: list[StructuredGroup]) -> list[Row]:
        """Rows straight from group records' prefix structure (``consumers.rows``)."""
        if not any(group.entries for group in groups):
            raise ValueError("groups: an empty batch cannot be converted")
        self._check_log_probs([entry.step for group in groups for entry in group.entries])
        return self._fit(structured_rows(groups, self.row_mode))

    @staticmethod
    def _check_log_probs(steps: list[Step]) -> None:
        for step in steps:
            if step.rollout_log_probs is not None and len(step.rollout_log_probs) != len(step.response_ids):
                raise ValueError(f"{name(step)}: {len(step.rollout_log_probs)} log-probs for "
                                 f"{len(step.response_ids)} response tokens")

    def _fit(self, rows: list[Row]) -> list[Row]:
        for row in rows:
            if len(row.prompt) > self.prompt_length:
                raise ValueError(f"{name(row.steps[0])}: prompt of {len(row.prompt)} tokens exceeds "
                                 f"prompt_length {self.prompt_length}")
            if len(row.response) > self.response_length:
                raise ValueError(f"{name(row.steps[-1])}: response of {len(row.response)} tokens exceeds "
                                 f"response_length {self.response_length}")
        return rows

    # -- tensors ---------------------------------------------------------------------
    def convert(self, steps: list[Step], current_version: int | None = None) -> DataProto:
        return self.batch(self.rows(steps), current_version)

    def convert_groups(self, groups: list[StructuredGroup], current_version: int | None = None) -> DataProto:
        return self.batch(self.structured_rows(groups), current_version)

    def batch(self, rows: list[Row], current_version: int | None = None) -> DataProto:
        """The padded tensors of checked rows."""
        import torch  # with verl: only where batches are built, not wherever trajbus is imported
        from verl import DataProto

        n, p_len, r_len = len(rows), self.prompt_length, self.response_length
        prompts = np.full((n, p_len), self.pad_token_id, dtype=np.int64)
        responses = np.full((n, r_len), self.pad_token_id, dtype=np.int64)
        prompt_mask = np.zeros((n, p_len), dtype=np.int64)
        response_attention = np.zeros((n, r_len), dtype=np.int64)
        response_mask = np.zeros((n, r_len), dtype=np.int64)
        scores = np.zeros((n, r_len), dtype=np.float32)
        with_log_probs = all(row.log_probs is not None for row in rows)
        log_probs = np.zeros((n, r_len), dtype=np.float32)
        oldest = np.array([min(s.policy_version for s in row.steps) for row in rows], dtype=np.int64)
        token_versions = np.repeat(oldest[:, None], r_len, axis=1)
        for i, row in enumerate(rows):  # slice assignments; the arrays are allocated once
            p, r = len(row.prompt), len(row.response)
            prompts[i, p_len - p:] = row.prompt
            prompt_mask[i, p_len - p:] = 1
            responses[i, :r] = row.response
            response_attention[i, :r] = 1
            response_mask[i, :r] = row.response_mask
            real = np.flatnonzero(response_mask[i, :r])
            if r:
                scores[i, real[-1] if len(real) else r - 1] = row.reward
            if with_log_probs:
                log_probs[i, :r] = row.log_probs
            if row.versions is not None:
                token_versions[i, :r] = row.versions
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
        tensors["token_policy_version"] = torch.from_numpy(token_versions)
        if current_version is not None:
            tensors["token_staleness"] = torch.from_numpy(staleness(token_versions, current_version) * response_mask)
        non_tensors = {
            "uid": np.array([row.steps[0].prompt_uid for row in rows], dtype=object),  # what GRPO groups by
            "trajectory_uid": np.array([row.steps[0].trajectory_uid for row in rows], dtype=object),
            "step_index": np.array([row.steps[-1].step_index for row in rows], dtype=np.int64),
            "policy_version": oldest,
        }
        if current_version is not None:
            non_tensors["staleness"] = staleness(non_tensors["policy_version"], current_version)
        for key in sorted({k for row in rows for k in row.steps[-1].metadata} - set(non_tensors)):
            non_tensors[key] = np.array([row.steps[-1].metadata.get(key) for row in rows], dtype=object)
        meta_info = {"temperature": self.temperature, "row_mode": self.row_mode,
                     "current_policy_version": current_version,
                     "num_tokens": int(attention.sum()), "num_response_tokens": int(response_mask.sum())}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)
