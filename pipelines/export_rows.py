"""A group record's trajectories as the rows of an export (``trajbus export``), in the RL shape.

One row per trajectory. The tokens are stored once, as the trajectory produced them, never a
prompt per turn (16 turns of a 32k context would be 16 x 32k tokens; this is 32k):

- ``prompt_ids``: the first step's whole prompt;
- ``steps``: per step, in order, ``new_prompt_ids`` (the prompt tokens after the context the step
  extends: for the first step the row's ``prompt_ids``, so none; for a later one the previous
  step's prompt + response when ``extends_previous``, else, the agent having rewritten its history,
  the step's whole prompt), ``response_ids``, ``rollout_log_probs`` (one per response token, null
  when the engine gave none), ``policy_version`` and ``version_segments`` (``[start, version]``
  runs of response tokens a weight update cut; null: all ``policy_version``'s), ``reward``,
  ``is_last``, ``created_at`` and ``metadata`` (JSON);
- per row: ``reward`` (the last step's), ``policy_version`` (the oldest version that sampled any
  of its tokens, as a trainer's rows carry) and ``newest_policy_version``;
- provenance: ``topic``, ``partition``, ``offset`` (the group record on the groups topic: read it
  there to find the row's steps), ``prompt_uid``, ``trajectory_uid``, ``channel``, ``group_status``,
  ``ready_at`` (unix seconds the worker made the group ready), ``traceparent`` and ``trace_id``
  (the W3C context of the worker's emit span of the trajectory, when tracing was on).

Rows are built from the group record's prefix structure (``StructuredGroup``, decoded with
``arrays=True``): a step stored as extending its predecessor's whole context contributes its stored
tokens as they are, so a row costs its distinct tokens (``consumers.rows`` does the same for a
trainer); only any other step's prompt is rebuilt and compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from trajbus.streams.wire.prefix import (PROMPT_EXTENDS_SHARED, PROMPT_EXTENDS_STEP, PROMPT_FULL, PrefixError,
                                         StepDelta, StructuredGroup, as_tokens)
from trajbus.streams.wire.records import Step

__all__ = ["Provenance", "RL_SCHEMA", "RlColumns", "StepTokens", "TrajectoryTokens", "provenance", "trace_id",
           "trajectories"]

_EMPTY = np.zeros(0, np.uint32)

_SEGMENT = pa.struct([("start", pa.int32()), ("version", pa.int64())])
STEP_TYPE = pa.struct([
    ("step_index", pa.int32()), ("new_prompt_ids", pa.list_(pa.uint32())), ("extends_previous", pa.bool_()),
    ("response_ids", pa.list_(pa.uint32())), ("rollout_log_probs", pa.list_(pa.float32())),
    ("policy_version", pa.int64()), ("version_segments", pa.list_(_SEGMENT)), ("reward", pa.float64()),
    ("is_last", pa.bool_()), ("created_at", pa.float64()), ("metadata", pa.string()),
])
PROVENANCE_FIELDS = [
    ("prompt_uid", pa.string()), ("trajectory_uid", pa.string()), ("channel", pa.string()),
    ("group_status", pa.string()), ("ready_at", pa.float64()), ("topic", pa.string()), ("partition", pa.int32()),
    ("offset", pa.int64()), ("traceparent", pa.string()), ("trace_id", pa.string()),
    ("reward", pa.float64()), ("policy_version", pa.int64()), ("newest_policy_version", pa.int64()),
]
RL_SCHEMA = pa.schema(PROVENANCE_FIELDS + [("prompt_ids", pa.list_(pa.uint32())), ("steps", pa.list_(STEP_TYPE))])


@dataclass(frozen=True)
class Provenance:
    """Where a group record lies, and its ``trajbus-traceparents`` header (trajectory uid -> traceparent)."""

    topic: str
    partition: int
    offset: int
    traceparents: dict


def trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``); None when absent or malformed."""
    parts = traceparent.split("-") if isinstance(traceparent, str) else []
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


@dataclass
class StepTokens:
    """One step of a row: its step, the prompt tokens it adds, and the pieces of its whole prompt."""

    step: Step
    new_prompt: np.ndarray
    extends_previous: bool
    prompt_pieces: list[np.ndarray]
    """Concatenated: the step's whole prompt (references to the arrays read, nothing copied)."""

    def prompt(self) -> np.ndarray:
        return np.concatenate(self.prompt_pieces) if self.prompt_pieces else _EMPTY


@dataclass
class TrajectoryTokens:
    """A trajectory of a group record, its tokens as a row stores them."""

    uid: str
    prompt: np.ndarray
    steps: list[StepTokens]

    @property
    def reward(self) -> float:
        return float(self.steps[-1].step.reward)

    @property
    def versions(self) -> set[int]:
        """Every policy version that sampled a token of the trajectory."""
        return {int(v) for s in self.steps for v in
                ([s.step.policy_version] + [version for _, version in s.step.version_segments or ()])}


def provenance(trajectory: TrajectoryTokens, group: StructuredGroup, where: Provenance) -> dict:
    """A row's ``PROVENANCE_FIELDS``, by name."""
    parent = where.traceparents.get(trajectory.uid)
    versions = trajectory.versions
    return dict(zip([name for name, _ in PROVENANCE_FIELDS], [
        group.prompt_uid, trajectory.uid, group.fields["channel"], group.fields["status"], group.ready_at,
        where.topic, where.partition, where.offset, parent, trace_id(parent), trajectory.reward,
        min(versions), max(versions)]))


def _whole_prompt(entry: StepDelta, shared: np.ndarray, contexts: dict[int, list[np.ndarray]]) -> list[np.ndarray]:
    """The pieces of an entry's whole prompt: stored, or a stored prefix's first ``prefix_len`` tokens then stored."""
    stored = as_tokens(entry.step.prompt_ids)
    if entry.kind == PROMPT_FULL:
        return [stored]
    if entry.kind == PROMPT_EXTENDS_SHARED:
        return [as_tokens(shared)[:entry.prefix_len], stored]
    base = contexts.get(entry.base_index) if entry.kind == PROMPT_EXTENDS_STEP else None
    if base is None:
        raise PrefixError(f"step {entry.step.trajectory_uid}#{entry.step.step_index}: its prefix is not in the group")
    return [np.concatenate(base)[:entry.prefix_len], stored]


def _trajectory(uid: str, shared: np.ndarray, entries: list[StepDelta]) -> TrajectoryTokens:
    contexts: dict[int, list[np.ndarray]] = {}  # step_index -> pieces of its prompt + response
    lengths: dict[int, int] = {}
    steps: list[StepTokens] = []
    for entry in entries:
        step, before = entry.step, steps[-1].step if steps else None
        if before is not None and entry.kind == PROMPT_EXTENDS_STEP and entry.base_index == before.step_index \
                and entry.prefix_len == lengths[before.step_index]:  # stored as extending all of it
            new, extends = as_tokens(step.prompt_ids), True
            pieces = contexts[before.step_index] + [new]
        else:
            pieces = _whole_prompt(entry, shared, contexts)
            new, extends = _EMPTY, True
            if before is not None:
                prompt, context = np.concatenate(pieces), np.concatenate(contexts[before.step_index])
                extends = len(prompt) >= len(context) and np.array_equal(prompt[:len(context)], context)
                new = prompt[len(context):] if extends else prompt
        response = as_tokens(step.response_ids)
        contexts[step.step_index] = pieces + [response]
        lengths[step.step_index] = sum(len(piece) for piece in pieces) + len(response)
        steps.append(StepTokens(step, new, extends, pieces))
    return TrajectoryTokens(uid, steps[0].prompt() if steps else _EMPTY, steps)


def trajectories(group: StructuredGroup) -> list[TrajectoryTokens]:
    """The group's trajectories, in the record's order (by uid); ``PrefixError`` for a broken record."""
    by_uid: dict[str, list[StepDelta]] = {}
    for entry in group.entries:
        by_uid.setdefault(entry.step.trajectory_uid, []).append(entry)
    shared = as_tokens(group.shared)
    return [_trajectory(uid, shared, entries) for uid, entries in by_uid.items()]


def _offsets(lengths: list[int]) -> np.ndarray:
    """List offsets (int32) of lists of these lengths."""
    offsets = np.zeros(len(lengths) + 1, np.int32)
    offsets[1:] = np.cumsum(np.asarray(lengths, np.int64))
    return offsets


def _lists(pieces: list[np.ndarray], dtype: pa.DataType, valid: list[bool] | None = None) -> pa.Array:
    """A list array of ``pieces`` (one list each), built from one concatenation and its offsets."""
    offsets = _offsets([len(p) for p in pieces])
    values = pa.array(np.concatenate(pieces) if pieces else np.zeros(0), type=dtype)
    mask = None if valid is None or all(valid) else pa.array([not v for v in valid])
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask)


class RlColumns:
    """Rows of the RL shape gathered column by column, so a part's table is one concatenation per column."""

    def __init__(self) -> None:
        self.rows: dict[str, list] = {name: [] for name, _ in PROVENANCE_FIELDS}
        self.prompts: list[np.ndarray] = []
        self.step_counts: list[int] = []
        self.steps: dict[str, list] = {name: [] for name in STEP_TYPE.names}
        self.nbytes = 0
        """Token and log-prob bytes held: what bounds a part's size."""

    def __len__(self) -> int:
        return len(self.prompts)

    def add(self, trajectory: TrajectoryTokens, group: StructuredGroup, where: Provenance) -> None:
        for name, value in provenance(trajectory, group, where).items():
            self.rows[name].append(value)
        self.prompts.append(trajectory.prompt)
        self.step_counts.append(len(trajectory.steps))
        self.nbytes += 4 * len(trajectory.prompt)
        for tokens in trajectory.steps:
            self._add_step(tokens)

    def _add_step(self, tokens: StepTokens) -> None:
        step, columns = tokens.step, self.steps
        log_probs = step.rollout_log_probs
        columns["step_index"].append(step.step_index)
        columns["new_prompt_ids"].append(tokens.new_prompt)
        columns["extends_previous"].append(tokens.extends_previous)
        columns["response_ids"].append(as_tokens(step.response_ids))
        columns["rollout_log_probs"].append(log_probs)
        columns["policy_version"].append(step.policy_version)
        columns["version_segments"].append(step.version_segments)
        columns["reward"].append(step.reward)
        columns["is_last"].append(step.is_last)
        columns["created_at"].append(step.created_at)
        columns["metadata"].append(json.dumps(step.metadata) if step.metadata else None)
        self.nbytes += 4 * (len(tokens.new_prompt) + 2 * len(step.response_ids))

    def _step_array(self) -> pa.StructArray:
        c = self.steps
        log_probs = [np.asarray(v, np.float32) if v is not None else np.zeros(0, np.float32)
                     for v in c["rollout_log_probs"]]
        segments = pa.array([[{"start": s, "version": v} for s, v in seg] if seg else None
                             for seg in c["version_segments"]], type=pa.list_(_SEGMENT))
        arrays = [pa.array(c["step_index"], pa.int32()), _lists(c["new_prompt_ids"], pa.uint32()),
                  pa.array(c["extends_previous"], pa.bool_()), _lists(c["response_ids"], pa.uint32()),
                  _lists(log_probs, pa.float32(), [v is not None for v in c["rollout_log_probs"]]),
                  pa.array(c["policy_version"], pa.int64()), segments, pa.array(c["reward"], pa.float64()),
                  pa.array(c["is_last"], pa.bool_()), pa.array(c["created_at"], pa.float64()),
                  pa.array(c["metadata"], pa.string())]
        return pa.StructArray.from_arrays(arrays, fields=list(STEP_TYPE))

    def table(self) -> pa.Table:
        """The rows gathered, as a table of ``RL_SCHEMA``."""
        columns = [pa.array(self.rows[name], type) for name, type in PROVENANCE_FIELDS]
        columns += [_lists(self.prompts, pa.uint32()),
                    pa.ListArray.from_arrays(pa.array(_offsets(self.step_counts)), self._step_array())]
        return pa.Table.from_arrays(columns, schema=RL_SCHEMA)
