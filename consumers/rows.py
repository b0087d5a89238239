"""Training rows before padding: from full steps, or straight from group records' prefix structure.

A row is a prompt, a response and its mask (see ``consumers.backends`` for the two row
modes). From full steps, a trajectory row re-checks that each prompt extends the step
before it, which reads every prompt: turns x context. From a group record
(``StructuredGroup``) the check is already written down: a step stored as extending
the whole prompt + response of the step before it contributes only its stored tokens,
so a trajectory row costs its distinct tokens; anything else is rebuilt and compared.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from trajbus.streams.wire.prefix import PROMPT_EXTENDS_SHARED, PROMPT_EXTENDS_STEP, PROMPT_FULL, StepDelta, \
    StructuredGroup, as_tokens
from trajbus.streams.wire.records import CONTINUES, SEGMENT_START, Step
from trajbus.streams.wire.versions import token_versions


@dataclass
class Row:
    """One training row before padding."""

    prompt: list[int] | np.ndarray
    """Lists from full steps, numpy arrays from a ``StructuredGroup`` (so are the next three)."""
    response: list[int] | np.ndarray
    response_mask: list[int] | np.ndarray
    log_probs: list[float] | np.ndarray | None
    reward: float
    steps: list[Step]
    """The row's steps; from a ``StructuredGroup`` their ``prompt_ids`` are only the stored tokens."""
    versions: np.ndarray | None = None
    """One policy version per response token (int64): the version that sampled it (a weight update may cut a
    generation, ``streams.wire.versions``); tokens between two model outputs take the next step's version."""


def step_versions(step: Step, between: int = 0) -> np.ndarray:
    """The versions of ``between`` tokens before a step's response (its ``policy_version``), then of its response."""
    response = token_versions(step.version_segments, len(step.response_ids), step.policy_version)
    return np.concatenate([np.full(between, step.policy_version, np.int64), response]) if between else response


def name(step: Step) -> str:
    return f"step {step.trajectory_uid}#{step.step_index}"


def check_group(steps: list[Step]) -> list[Step]:
    """One prompt group: every step shares the first step's prompt_uid (GRPO groups by it)."""
    for step in steps:
        if step.prompt_uid != steps[0].prompt_uid:
            raise ValueError(f"{name(step)}: prompt_uid {step.prompt_uid!r} differs from its group's "
                             f"{steps[0].prompt_uid!r}")
    return steps


def _not_extending(step: Step) -> ValueError:
    return ValueError(f"{name(step)}: its prompt does not extend the prompt and response of the step it "
                      f"continues; use row_mode='step' for this trajectory")


def segments(trajectory: list[Step]) -> list[list[Step]]:
    """A trajectory's steps (ordered by step_index) cut into rows: a step continues the previous
    step, or the one its ``continues`` metadata names, unless it is marked ``segment_start``."""
    found: list[list[Step]] = []
    tips: dict[int, list[Step]] = {}  # step_index of a segment's last step -> the segment
    for previous, step in zip([None, *trajectory], trajectory):
        if previous is None or step.metadata.get(SEGMENT_START):
            segment = [step]
            found.append(segment)
        else:
            segment = tips.pop(step.metadata.get(CONTINUES, previous.step_index), None)
            if segment is None:
                raise ValueError(f"{name(step)}: the step it continues is not in the batch; "
                                 f"use row_mode='step' for this trajectory")
            segment.append(step)
        tips[step.step_index] = segment
    return found


def by_trajectory(steps: list[Step]) -> list[list[Step]]:
    grouped: dict[str, list[Step]] = {}
    for step in steps:
        grouped.setdefault(step.trajectory_uid, []).append(step)
    return [check_group(sorted(trajectory, key=lambda s: s.step_index)) for trajectory in grouped.values()]


def step_rows(steps: list[Step]) -> list[Row]:
    return [Row(s.prompt_ids, s.response_ids, [1] * len(s.response_ids), s.rollout_log_probs, s.reward, [s],
                step_versions(s)) for s in steps]


def trajectory_rows(steps: list[Step]) -> list[Row]:
    """Rows of full steps: each prompt checked against the prompt and response it continues."""
    return [_segment_row(segment, trajectory[-1].reward)
            for trajectory in by_trajectory(steps) for segment in segments(trajectory)]


def _segment_row(segment: list[Step], reward: float) -> Row:
    first = segment[0]
    context = list(first.prompt_ids)
    response: list[int] = []
    mask: list[int] = []
    versions: list[np.ndarray] = []
    log_probs: list[float] | None = [] if all(s.rollout_log_probs is not None for s in segment) else None
    for step in segment:
        if step.prompt_ids[:len(context)] != context:
            raise _not_extending(step)
        between = step.prompt_ids[len(context):]
        response += between + step.response_ids
        mask += [0] * len(between) + [1] * len(step.response_ids)
        versions.append(step_versions(step, len(between)))
        if log_probs is not None:
            log_probs += [0.0] * len(between) + list(step.rollout_log_probs)
        context = list(step.prompt_ids) + list(step.response_ids)
    return Row(list(first.prompt_ids), response, mask, log_probs, reward, segment, np.concatenate(versions))


def _joined(prompt: np.ndarray, pieces: list[tuple], reward: float, segment: list[Step]) -> Row:
    """A row of ``prompt``, then per step the tokens between (mask 0) and its response (mask 1)."""
    with_log_probs = all(log_probs is not None for _, _, log_probs in pieces)
    response, mask, log_probs = [], [], []
    versions = [step_versions(step, len(between)) for step, (between, _, _) in zip(segment, pieces)]
    for between, answer, answer_log_probs in pieces:
        response += [as_tokens(between), as_tokens(answer)]
        mask += [np.zeros(len(between), np.int8), np.ones(len(answer), np.int8)]
        if with_log_probs:
            log_probs += [np.zeros(len(between), np.float32), np.asarray(answer_log_probs, np.float32)]
    return Row(as_tokens(prompt), np.concatenate(response), np.concatenate(mask),
               np.concatenate(log_probs) if with_log_probs else None, reward, segment, np.concatenate(versions))


class _Prompts:
    """Full prompts of one trajectory's entries, rebuilt from their bases only when asked; a
    context (prompt + response) is kept while a later entry still extends it."""

    def __init__(self, shared: np.ndarray, entries: list[StepDelta]) -> None:
        self.shared = shared
        self.entries = {entry.step.step_index: entry for entry in entries}
        self.wanted = Counter(e.base_index for e in entries if e.kind == PROMPT_EXTENDS_STEP)
        self.contexts: dict[int, np.ndarray] = {}

    def prompt(self, entry: StepDelta) -> np.ndarray:
        chain = [entry]  # back to a stored base: a full prompt, the shared one, or a kept context
        while chain[-1].kind == PROMPT_EXTENDS_STEP and chain[-1].base_index not in self.contexts:
            chain.append(self.entries[chain[-1].base_index])
        context = None  # of the link before, while walking forward
        for link in reversed(chain):
            stored = as_tokens(link.step.prompt_ids)
            if link.kind == PROMPT_FULL:
                prompt = stored
            else:
                base = (self.shared if link.kind == PROMPT_EXTENDS_SHARED else
                        context if context is not None else self.context(link.base_index))
                if link.kind == PROMPT_EXTENDS_STEP and base is context:
                    self._used(link.base_index)
                prompt = np.concatenate([base[:link.prefix_len], stored])
            context = np.concatenate([prompt, as_tokens(link.step.response_ids)])
            if self.wanted[link.step.step_index] > 0:
                self.contexts[link.step.step_index] = context
        return prompt

    def context(self, step_index: int) -> np.ndarray:
        """The prompt + response of a step (one use of it, when kept)."""
        if step_index not in self.contexts:
            entry = self.entries[step_index]
            return np.concatenate([self.prompt(entry), as_tokens(entry.step.response_ids)])
        context = self.contexts[step_index]
        self._used(step_index)
        return context

    def _used(self, step_index: int) -> None:
        self.wanted[step_index] -= 1
        if self.wanted[step_index] <= 0:
            self.contexts.pop(step_index, None)


def _trajectories(group: StructuredGroup) -> list[list[StepDelta]]:
    found: dict[str, list[StepDelta]] = {}
    for entry in group.entries:
        found.setdefault(entry.step.trajectory_uid, []).append(entry)
    return list(found.values())


def structured_rows(groups: list[StructuredGroup], row_mode: str) -> list[Row]:
    """Rows of group records, from their stored deltas (see the module docstring)."""
    rows = []
    for group in groups:
        shared = as_tokens(group.shared)
        check_group([entry.step for entry in group.entries])
        for entries in _trajectories(group):
            prompts = _Prompts(shared, entries)
            if row_mode == "step":
                rows += [Row(prompts.prompt(e), e.step.response_ids, np.ones(len(e.step.response_ids), np.int8),
                             e.step.rollout_log_probs, e.step.reward, [e.step], step_versions(e.step))
                         for e in entries]
                continue
            by_index = {entry.step.step_index: entry for entry in entries}
            for segment in segments([entry.step for entry in entries]):
                rows.append(_structured_segment(prompts, [by_index[s.step_index] for s in segment],
                                                entries[-1].step.reward))
    return rows


def _structured_segment(prompts: _Prompts, segment: list[StepDelta], reward: float) -> Row:
    pieces = [(as_tokens([]), segment[0].step.response_ids, segment[0].step.rollout_log_probs)]
    for before, entry in zip(segment, segment[1:]):
        step, room = entry.step, before.prompt_len + len(before.step.response_ids)
        if entry.kind == PROMPT_EXTENDS_STEP and entry.base_index == before.step.step_index \
                and entry.prefix_len == room:
            between = as_tokens(step.prompt_ids)  # stored as extending all of it: nothing to compare
        else:
            prompt, context = prompts.prompt(entry), prompts.context(before.step.step_index)
            if len(prompt) < len(context) or not np.array_equal(prompt[:len(context)], context):
                raise _not_extending(step)
            between = prompt[len(context):]
        pieces.append((between, step.response_ids, step.rollout_log_probs))
    return _joined(prompts.prompt(segment[0]), pieces, reward, [entry.step for entry in segment])
