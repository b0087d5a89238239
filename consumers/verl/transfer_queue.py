"""A ready prompt group in the layout verl's V1 trainer reads from TransferQueue.

verl's V1 agent loop (``verl.trainer.ppo.v1.agent_loop_tq``) puts each finished trajectory under the key
``{uid}_{session_id}_{i}`` (``uid``: the prompt's, as the trainer registered it; ``session_id``: which of
the ``rollout.n`` samples; ``i``: the output's index when one agent loop returns several), unpadded:

- fields: what ``AgentLoopOutput.as_dict()`` gives (``prompts``, ``responses``, ``response_mask``,
  ``rollout_log_probs`` where the engine gave them, ``rm_scores`` with the reward on the last response
  token, ``num_turns``, ``metrics``, ``extra_fields``), then the prompt's own fields and ``session_id``,
  then ``loss_mask``, ``input_ids``, ``position_ids`` and ``multi_modal_inputs``;
- tags: ``status: success``, ``prompt_len``, ``response_len``, ``seq_len``, ``global_steps`` (the step
  that drew the prompt) and ``min_global_steps`` / ``max_global_steps`` (the oldest and newest policy
  version that sampled a token of the row: verl's replay buffer drops or waits on staleness by them).

trajbus's rows (``consumers.rows``) are exactly that, one per trajectory (``i`` > 0 where a rewritten
context split a trajectory into segments); the session of a trajectory is the number its metadata names
under ``session_key`` (else its order in the group). trajbus adds ``token_policy_version`` (the version
that sampled each response token) and, in ``extra_fields``, the trajectory's and the group's uids.
Text only: ``position_ids`` count the tokens, ``multi_modal_inputs`` is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajbus.consumers.rows import Row, structured_rows
from trajbus.consumers.verl.groups import metrics, sampled_versions
from trajbus.streams.wire.prefix import StructuredGroup

ROW_MODE = "trajectory"
"""One row per trajectory (per segment), as verl's agent loop returns one output per session."""


@dataclass
class TQRecords:
    """What one ``kv_batch_put`` writes: a key, a field dict and a tag dict per row."""

    keys: list[str] = field(default_factory=list)
    fields: list[dict[str, Any]] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)


def sessions(rows: list[Row], session_key: str) -> list[tuple[int, int]]:
    """``(session_id, output index)`` of each row: the session its trajectory's metadata names (else the
    trajectory's order in the group), and the row's order within its trajectory."""
    order: dict[str, int] = {}
    seen: dict[str, int] = {}
    result = []
    for row in rows:
        trajectory = row.steps[0].trajectory_uid
        if trajectory not in order:
            named = row.steps[-1].metadata.get(session_key)
            order[trajectory] = int(named) if isinstance(named, int) else len(order)
        result.append((order[trajectory], seen.get(trajectory, 0)))
        seen[trajectory] = seen.get(trajectory, 0) + 1
    return result


def row_fields(row: Row, prompt: dict[str, Any], session_id: int) -> dict[str, Any]:
    """One row's fields, in the order verl's agent loop builds them (module docstring)."""
    import torch  # with verl: only where rows are laid out for its trainer

    versions = sampled_versions(row)
    response_mask = torch.as_tensor(np.asarray(row.response_mask, dtype=np.int64))
    rm_scores = torch.zeros(len(row.response), dtype=torch.float32)
    real = np.flatnonzero(np.asarray(row.response_mask))
    if len(row.response):
        rm_scores[int(real[-1]) if len(real) else len(row.response) - 1] = float(row.reward)
    fields: dict[str, Any] = {
        "prompts": torch.as_tensor(np.asarray(row.prompt, dtype=np.int64)),
        "responses": torch.as_tensor(np.asarray(row.response, dtype=np.int64)),
        "response_mask": response_mask,
        "num_turns": 2 * len(row.steps),
        "metrics": metrics(row),
        "extra_fields": {"min_global_steps": int(versions.min()), "max_global_steps": int(versions.max()),
                         "reward_extra_info": {}, "turn_scores": [], "tool_rewards": [],
                         "trajectory_uid": row.steps[0].trajectory_uid, "prompt_uid": row.steps[0].prompt_uid},
    }
    if row.log_probs is not None:
        fields["rollout_log_probs"] = torch.as_tensor(np.asarray(row.log_probs, dtype=np.float32))
    fields["rm_scores"] = rm_scores
    if row.versions is not None:
        fields["token_policy_version"] = torch.as_tensor(np.asarray(row.versions, dtype=np.int64))
    else:
        fields["token_policy_version"] = torch.full((len(row.response),), int(versions.min()), dtype=torch.int64)
    fields.update(prompt)
    fields["session_id"] = session_id
    input_ids = torch.cat([fields["prompts"], fields["responses"]])
    fields.update(loss_mask=response_mask, input_ids=input_ids, position_ids=torch.arange(len(input_ids)),
                  multi_modal_inputs={})
    return fields


def group_records(group: StructuredGroup, uid: str, prompt: dict[str, Any], session_key: str) -> TQRecords:
    """The TransferQueue records of one ready group, for the prompt verl registered as ``uid`` (``prompt``:
    its fields as verl's agent loop passes them on, ``global_steps`` among them)."""
    rows = structured_rows([group], ROW_MODE)
    records = TQRecords()
    for row, (session_id, index) in zip(rows, sessions(rows, session_key)):
        fields = row_fields(row, prompt, session_id)
        prompt_len, response_len = len(row.prompt), len(row.response)
        extra = fields["extra_fields"]
        records.keys.append(f"{uid}_{session_id}_{index}")
        records.fields.append(fields)
        records.tags.append({"status": "success", "prompt_len": prompt_len, "response_len": response_len,
                             "seq_len": prompt_len + response_len, "global_steps": prompt.get("global_steps"),
                             "min_global_steps": extra["min_global_steps"],
                             "max_global_steps": extra["max_global_steps"]})
    return records
