"""slime's ``Sample`` where slime is installed, and an assembled prompt group as slime Samples.

``sample_kind`` is slime's ``slime.utils.types.Sample`` when that module imports (slime is not on
PyPI; the PyPI package named ``slime`` has no ``slime.utils.types``), else trajbus's ``Sample``,
which has the same field names and ``Status`` values. It is asked each time a data source is
built, not once at import, so a process that installs slime later (or a test's stand-in) is seen.

``samples_from_group`` is the seam for a rollout function whose agents go through trajbus's gateway:
the stream worker assembles their steps into a ``ReadyGroup``; this turns its steps into the
Samples slime trains on, one per row (``consumers.rows``: a trajectory, multi-turn in one row, or one
LLM call), each carrying the prompt, label, metadata, ``index``, ``group_index`` and ``prompt_uid`` of
the sample the data source handed out for that trajectory.
"""

from __future__ import annotations

from typing import Any

from trajbus.consumers.rows import Row, step_rows, trajectory_rows
from trajbus.consumers.slime.sample_kind import TRAJBUS_SAMPLES, SampleKind
from trajbus.streams.wire.records import Step

__all__ = ["ROW_MODES", "sample_kind", "samples_from_group", "slime_sample_class"]

ROW_MODES = ("trajectory", "step")
FINISH_REASON = "finish_reason"
"""Step metadata key the gateway records the engine's finish reason under (``length``: cut by the budget)."""
POLICY_VERSIONS = "policy_versions"
"""Sample metadata key: one policy version per response token, where they are not all one version."""


def slime_sample_class() -> type | None:
    """slime's own ``Sample`` class, or None where slime is not installed."""
    try:
        from slime.utils.types import Sample
    except ImportError:
        return None
    return Sample


def sample_kind() -> SampleKind:
    """slime's ``Sample`` when slime is importable, else trajbus's (same field names, same ``Status`` values)."""
    cls = slime_sample_class()
    return SampleKind(cls) if cls is not None else TRAJBUS_SAMPLES


def _trajectory_order(rows: list[Row]) -> dict[str, int]:
    """trajectory_uid -> its position among the group's trajectories (sorted, as ``ReadyGroup`` lists them)."""
    return {uid: position for position, uid in enumerate(sorted({row.steps[0].trajectory_uid for row in rows}))}


def samples_from_group(steps: list[Step], dispatched: list[Any], kind: SampleKind | None = None,
                       row_mode: str = "trajectory", tokenizer: Any = None) -> list[Any]:
    """The Samples of one assembled group (``ReadyGroup.steps``), one per row, in trajectory order.

    ``dispatched``: the group as the data source handed it out; trajectory i (sorted by uid) takes
    sample i's prompt fields and ``index``, which is also its ``rollout_id`` (the rows one trajectory
    is cut into share it). ``tokens`` are prompt + response, ``loss_mask`` is 1 on the model's tokens
    and 0 on those between turns (tool results), ``status`` is ``TRUNCATED`` when the last call hit
    its length budget, ``weight_versions`` has one entry per run of one version (a call cut by a weight
    update has two) and, where those differ, ``metadata[POLICY_VERSIONS]`` the version of each response
    token. With a ``tokenizer``, ``response`` is the response decoded."""
    if row_mode not in ROW_MODES:
        raise ValueError(f"row_mode: expected one of {', '.join(ROW_MODES)}, got {row_mode!r}")
    kind = kind or sample_kind()
    rows = trajectory_rows(steps) if row_mode == "trajectory" else step_rows(steps)
    order = _trajectory_order(rows)
    if len(order) > len(dispatched):
        raise ValueError(f"prompt_uid {steps[0].prompt_uid}: {len(order)} trajectories, but {len(dispatched)} "
                         f"samples were handed out for it")
    samples = []
    for row in rows:
        base = dispatched[order[row.steps[0].trajectory_uid]]
        sample = kind.new(base)
        response = [int(token) for token in row.response]
        sample.tokens = [int(token) for token in row.prompt] + response
        sample.response_length = len(response)
        sample.loss_mask = [int(bit) for bit in row.response_mask]
        sample.rollout_log_probs = None if row.log_probs is None else [float(p) for p in row.log_probs]
        sample.reward = float(row.reward)
        sample.rollout_id = base.index
        sample.weight_versions = [str(version) for step in row.steps
                                  for _, version in (step.version_segments or [[0, step.policy_version]])]
        truncated = row.steps[-1].metadata.get(FINISH_REASON) == "length"
        sample.status = kind.status.TRUNCATED if truncated else kind.status.COMPLETED
        sample.metadata = {**(base.metadata or {}), "trajectory_uid": row.steps[0].trajectory_uid}
        versions = [] if row.versions is None else [int(version) for version in row.versions]
        if len(set(versions)) > 1:  # a weight update cut a generation, or turns came from two versions
            sample.metadata[POLICY_VERSIONS] = versions
        if tokenizer is not None:
            sample.response = tokenizer.decode(response)
        samples.append(sample)
    return samples
