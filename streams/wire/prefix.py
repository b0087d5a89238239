"""Prefix sharing (wire schema v2): a step's prompt as a reference plus only its new tokens.

In a multi-turn trajectory each prompt is the previous prompt + response + the
new turn, so full steps repeat the conversation on every turn: bytes grow with
turns x context. Schema v2 stores a prompt as one of

- ``PROMPT_FULL``: every token (a keyframe);
- ``PROMPT_EXTENDS_STEP``: the first ``prefix_len`` tokens of the prompt + response
  of step ``base_index`` of the same trajectory, then the tokens stored;
- ``PROMPT_EXTENDS_SHARED``: the first ``prefix_len`` tokens of the prompt a group
  record stores once for all its rollouts, then the tokens stored (groups only).

Writers find the shared prefix themselves (``PrefixEncoder``); readers rebuild
full prompts (``PrefixResolver``). A steps-topic reference always points at an
earlier record of the same partition, and a keyframe is written at least every
``KEYFRAME_EVERY`` steps of a trajectory: resolving a step never reads further
back than its keyframe, whose ``created_at`` the reference names.
"""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass
from typing import Union

import numpy as np
from cachetools import LRUCache

from trajbus.streams.wire.records import ReadyGroup, Step
from trajbus.streams.wire.token_prefix import begins_with

Tokens = Union[np.ndarray, array, list[int]]
"""A context as it is kept: a reader's are numpy; a writer's are the caller's kind (``array('I')`` or a list)."""
PROMPT_FULL = 0
PROMPT_EXTENDS_STEP = 1
PROMPT_EXTENDS_SHARED = 2
KEYFRAME_EVERY = 64
"""Steps of a trajectory between keyframes at most: bounds how far back a reader resolves."""
DEFAULT_MEMORY_BYTES = 256 * 2**20
RECENT_PER_TRAJECTORY = 4
"""Contexts a resolver keeps per trajectory: a step may extend one before the latest (``n > 1`` choices)."""


class PrefixError(ValueError):
    """A stored prefix cannot be resolved: its base is missing or shorter than the prefix."""


@dataclass
class StepDelta:
    """A step whose ``step.prompt_ids`` hold only the tokens after a prefix stored elsewhere."""

    step: Step
    kind: int
    prefix_len: int
    base_index: int = 0
    keyframe_at: float = 0.0

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + len(self.step.prompt_ids)


@dataclass
class Context:
    """A step's prompt + response, what the next step of its trajectory may extend."""

    step_index: int
    tokens: Tokens
    keyframe_at: float
    depth: int
    """Steps since the trajectory's last keyframe."""

    @property
    def nbytes(self) -> int:
        if isinstance(self.tokens, np.ndarray):
            return self.tokens.nbytes
        return (self.tokens.itemsize if isinstance(self.tokens, array) else 8) * len(self.tokens)


def as_tokens(ids: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(ids, dtype=np.uint32)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if len(mismatch) else n


def context_of(step: Step, prompt: np.ndarray, keyframe_at: float, depth: int) -> Context:
    return Context(step.step_index, np.concatenate([prompt, as_tokens(step.response_ids)]), keyframe_at, depth)


def _nbytes(contexts: list[Context]) -> int:
    return sum(context.nbytes for context in contexts)


class _Memory:
    """Contexts by trajectory, least recently used first out, bounded by their bytes (cachetools' ``LRUCache``
    sized by ``_nbytes``). A trajectory whose contexts alone exceed the bound is not kept: a writer sends its
    next step whole (a keyframe)."""

    def __init__(self, max_bytes: int) -> None:
        self.by_trajectory: LRUCache[str, list[Context]] = LRUCache(max_bytes, getsizeof=_nbytes)

    @property
    def bytes(self) -> int:
        return int(self.by_trajectory.currsize)

    def recent(self, trajectory_uid: str) -> list[Context]:
        return self.by_trajectory.get(trajectory_uid, [])

    def remember(self, trajectory_uid: str, context: Context, keep: int) -> None:
        contexts = [c for c in self.by_trajectory.pop(trajectory_uid, []) if c.step_index != context.step_index]
        contexts = [*contexts, context][-keep:]
        if _nbytes(contexts) <= self.by_trajectory.maxsize:
            self.by_trajectory[trajectory_uid] = contexts

    def forget(self, trajectory_uid: str) -> None:
        self.by_trajectory.pop(trajectory_uid, None)


class PrefixEncoder:
    """Producer side: remembers the last step sent per trajectory and expresses the next one against it.

    It keeps a context in the caller's kind: a token array (``array('I')``, 4 bytes a token, as the gateway
    holds them) or a list (pointers to the caller's ints, 8 bytes a token). An agent's next prompt is usually
    that context extended, which one C-speed comparison in place confirms, so a step costs its new tokens, not its
    context."""

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_BYTES, keyframe_every: int = KEYFRAME_EVERY) -> None:
        self.memory = _Memory(max_bytes)
        self.keyframe_every = keyframe_every

    def extended(self, step: Step) -> int:
        """How many leading prompt tokens are the whole context of the trajectory's last step
        sent (0 if the prompt does not extend all of it): tokens already validated."""
        recent = self.memory.by_trajectory.get(step.trajectory_uid)
        if not recent:
            return 0
        context = recent[-1].tokens
        return len(context) if begins_with(step.prompt_ids, context) else 0  # arrays: compared in place

    def delta(self, step: Step) -> StepDelta:
        """``step`` as it goes on the wire; it becomes the base the trajectory's next step may extend."""
        recent = self.memory.recent(step.trajectory_uid)
        base = recent[-1] if recent else None
        prefix_len = self.extended(step)
        if base is not None and not prefix_len:  # not the whole context: where do they part?
            prefix_len = common_prefix(as_tokens(step.prompt_ids), as_tokens(base.tokens))
        context = step.prompt_ids + array("I", step.response_ids) if isinstance(step.prompt_ids, array) \
            else [*step.prompt_ids, *step.response_ids]
        if base is None or prefix_len == 0 or base.depth + 1 >= self.keyframe_every:
            delta = StepDelta(step, PROMPT_FULL, 0)
            remembered = Context(step.step_index, context, step.created_at, 0)
        else:
            delta = StepDelta(dataclasses.replace(step, prompt_ids=step.prompt_ids[prefix_len:]),
                              PROMPT_EXTENDS_STEP, prefix_len, base.step_index, base.keyframe_at)
            remembered = Context(step.step_index, context, base.keyframe_at, base.depth + 1)
        if step.is_last:
            self.memory.forget(step.trajectory_uid)
        else:
            self.memory.remember(step.trajectory_uid, remembered, keep=1)
        return delta

    def remembered(self, trajectory_uid: str, step_index: int) -> Tokens | None:
        """The context kept for the trajectory's step ``step_index`` (its prompt + response, in the caller's
        kind), or None: a caller that keeps the same context shares this object instead of a copy of it (never
        changed in place, by either)."""
        recent = self.memory.recent(trajectory_uid)
        return recent[-1].tokens if recent and recent[-1].step_index == step_index else None

    def forget(self, trajectory_uid: str) -> None:
        """The trajectory ended, or a step of it may not have reached the broker: its next step is a keyframe."""
        self.memory.forget(trajectory_uid)


class PrefixResolver:
    """Reader side: full steps back from deltas read in offset order."""

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        self.memory = _Memory(max_bytes)

    def knows(self, delta: StepDelta) -> bool:
        return any(c.step_index == delta.base_index for c in self.memory.recent(delta.step.trajectory_uid))

    def resolve(self, record: Step | StepDelta) -> Step:
        """The full step; raises ``PrefixError`` when its base was not read (or not kept)."""
        if isinstance(record, Step):
            self.memory.remember(record.trajectory_uid,
                                 context_of(record, as_tokens(record.prompt_ids), record.created_at, 0),
                                 RECENT_PER_TRAJECTORY)
            return record
        step = record.step
        base = next((c for c in self.memory.recent(step.trajectory_uid) if c.step_index == record.base_index), None)
        if record.kind != PROMPT_EXTENDS_STEP or base is None:
            raise PrefixError(f"step {step.trajectory_uid}#{step.step_index}: extends step {record.base_index}, "
                              f"which was not read before it")
        if record.prefix_len > len(base.tokens):
            raise PrefixError(f"step {step.trajectory_uid}#{step.step_index}: a prefix of {record.prefix_len} "
                              f"tokens of step {record.base_index}, which has {len(base.tokens)}")
        prompt = np.concatenate([base.tokens[:record.prefix_len], as_tokens(step.prompt_ids)])
        self.memory.remember(step.trajectory_uid, context_of(step, prompt, record.keyframe_at, base.depth + 1),
                             RECENT_PER_TRAJECTORY)
        return dataclasses.replace(step, prompt_ids=prompt.tolist())


# -- group records ---------------------------------------------------------------------

def _against(step: Step, prompt: np.ndarray, shared: np.ndarray, base: Context | None) -> StepDelta:
    """``step`` stored against its trajectory's previous step or the group's shared prompt, whichever shares more."""
    on_base = common_prefix(prompt, base.tokens) if base is not None else 0
    on_shared = common_prefix(prompt, shared)
    if on_base == 0 and on_shared == 0:
        return StepDelta(dataclasses.replace(step, prompt_ids=prompt), PROMPT_FULL, 0)
    if base is not None and on_base >= on_shared:
        return StepDelta(dataclasses.replace(step, prompt_ids=prompt[on_base:]), PROMPT_EXTENDS_STEP, on_base,
                         base.step_index)
    return StepDelta(dataclasses.replace(step, prompt_ids=prompt[on_shared:]), PROMPT_EXTENDS_SHARED, on_shared)


def structure(steps: list[Step]) -> tuple[np.ndarray, list[StepDelta]]:
    """Full steps, ordered by (trajectory, step), as a group record stores them: the first
    step's prompt once, and each prompt against that or its trajectory's previous step."""
    shared = as_tokens(steps[0].prompt_ids) if steps else as_tokens([])
    entries: list[StepDelta] = []
    previous: Context | None = None
    for i, step in enumerate(steps):
        if i and steps[i - 1].trajectory_uid != step.trajectory_uid:
            previous = None
        prompt = as_tokens(step.prompt_ids)
        entries.append(_against(step, prompt, shared, previous))
        previous = context_of(step, prompt, 0.0, 0)
    return shared, entries


def regroup(chosen: list[Step | StepDelta], others: list[Step | StepDelta]) -> tuple[np.ndarray, list[StepDelta]]:
    """A group record's structure from steps-topic records, without rebuilding their prompts.

    ``chosen``: the group's steps, ordered by (trajectory, step); ``others``: the rest of
    their trajectories' records, needed only where a step extends one left out of the group.
    A reference between two steps of the group is kept as it is; any other step (a keyframe)
    is stored against the group's shared prompt (the first step's) or its trajectory's
    previous step in the group, rebuilt for that. Raises ``PrefixError``.
    """
    first = chosen[0] if chosen else Step(prompt_ids=[], response_ids=[], trajectory_uid="-", prompt_uid="-")
    if isinstance(first, StepDelta):
        first = resolve_chain(first, chosen + others)
    shared = as_tokens(first.prompt_ids)
    in_group = {(step_of(r).trajectory_uid, step_of(r).step_index): r for r in chosen}
    entries = []
    previous: Step | StepDelta | None = None  # the trajectory's step before, in the group
    for record in chosen:
        step = step_of(record)
        if previous is not None and step_of(previous).trajectory_uid != step.trajectory_uid:
            previous = None
        if isinstance(record, StepDelta):
            base = in_group.get((step.trajectory_uid, record.base_index))
            if base is not None and record.base_index < step.step_index:
                room = _prompt_len(base) + len(step_of(base).response_ids)
                if record.prefix_len > room:
                    raise PrefixError(f"step {step.trajectory_uid}#{step.step_index}: a prefix of "
                                      f"{record.prefix_len} tokens of step {record.base_index}, which has {room}")
                entries.append(StepDelta(step, PROMPT_EXTENDS_STEP, record.prefix_len, record.base_index))
                previous = record
                continue
            step = resolve_chain(record, chosen + others)
        base = None
        if previous is not None:
            before = previous if isinstance(previous, Step) else resolve_chain(previous, chosen + others)
            base = context_of(before, as_tokens(before.prompt_ids), 0.0, 0)
        entries.append(_against(step, as_tokens(step.prompt_ids), shared, base))
        previous = record
    return shared, entries


def step_of(record: Step | StepDelta) -> Step:
    """The step a record is about (of a delta: every field right but the prompt)."""
    return record.step if isinstance(record, StepDelta) else record


def with_step(record: Step | StepDelta, step: Step) -> Step | StepDelta:
    """``record`` with its step's fields replaced by ``step``'s (a delta keeps its prefix)."""
    return dataclasses.replace(record, step=step) if isinstance(record, StepDelta) else step


def _prompt_len(record: Step | StepDelta) -> int:
    return record.prompt_len if isinstance(record, StepDelta) else len(record.prompt_ids)


def resolve_chain(record: StepDelta, records: list[Step | StepDelta]) -> Step:
    """The full step, from the records of its trajectory (in any order); raises ``PrefixError``."""
    step = record.step
    by_index = {step_of(r).step_index: r for r in records if step_of(r).trajectory_uid == step.trajectory_uid
                and r is not record}
    chain = [record]
    while isinstance(chain[-1], StepDelta):
        base = by_index.pop(chain[-1].base_index, None)
        if base is None:
            raise PrefixError(f"step {step.trajectory_uid}#{step.step_index}: extends step "
                              f"{chain[-1].base_index}, which is not among its trajectory's records")
        chain.append(base)
    resolver = PrefixResolver(max_bytes=2**62)
    for link in reversed(chain):
        full = resolver.resolve(link)
    return full


def resolve_group(shared: list[int] | np.ndarray, entries: list[StepDelta]) -> list[Step]:
    """Full steps of a group record (the reader's side of ``structure``); raises ``PrefixError``.

    Prompts are Python lists built by slicing their base: they share the token objects, so
    a trajectory of T turns and context C costs T x C pointers, not T x C integers."""
    shared = _as_list(shared)
    steps: list[Step] = []
    contexts: dict[int, list[int]] = {}
    for i, entry in enumerate(entries):
        step = entry.step
        if i and entries[i - 1].step.trajectory_uid != step.trajectory_uid:
            contexts.clear()
        prompt = _as_list(step.prompt_ids)
        if entry.kind != PROMPT_FULL:
            base = shared if entry.kind == PROMPT_EXTENDS_SHARED else contexts.get(entry.base_index)
            if base is None or entry.prefix_len > len(base):
                raise PrefixError(f"step {step.trajectory_uid}#{step.step_index}: its prefix is not in the group")
            prompt = base[:entry.prefix_len] + prompt
        response = _as_list(step.response_ids)
        contexts[step.step_index] = prompt + response
        log_probs = None if step.rollout_log_probs is None else _as_list(step.rollout_log_probs)
        steps.append(dataclasses.replace(step, prompt_ids=prompt, response_ids=response, rollout_log_probs=log_probs))
    return steps


@dataclass
class StructuredGroup:
    """A decoded group record before its prompts are rebuilt: a trainer turns it into rows from
    the stored deltas (``consumers.rows``), never materialising every step's full prompt;
    ``ready()`` rebuilds the full steps."""

    shared: list[int] | np.ndarray
    entries: list[StepDelta]
    """Ordered by (trajectory_uid, step_index); each prompt against ``shared`` or an earlier step."""
    fields: dict
    """``ReadyGroup``'s other fields (prompt_uid, channel, n_rollouts, ready_at, status, metadata)."""

    @property
    def prompt_uid(self) -> str:
        return self.fields["prompt_uid"]

    @property
    def ready_at(self) -> float:
        return self.fields["ready_at"]

    def check(self) -> "StructuredGroup":
        """Every stored prefix lies within its base (``PrefixError`` if not): what ``ready()`` and a
        trainer's rows rely on, checked in O(steps)."""
        lengths: dict[int, int] = {}  # step_index -> prompt + response tokens, of the trajectory so far
        for i, entry in enumerate(self.entries):
            step = entry.step
            if i and self.entries[i - 1].step.trajectory_uid != step.trajectory_uid:
                lengths.clear()
            room = {PROMPT_FULL: 0, PROMPT_EXTENDS_SHARED: len(self.shared)}.get(
                entry.kind, lengths.get(entry.base_index, -1) if entry.base_index < step.step_index else -1)
            if entry.prefix_len > room:
                raise PrefixError(f"step {step.trajectory_uid}#{step.step_index}: its prefix is not in the group")
            lengths[step.step_index] = entry.prompt_len + len(step.response_ids)
        return self

    def ready(self) -> ReadyGroup:
        """The group with full steps; raises ``PrefixError``."""
        return ReadyGroup(steps=resolve_group(self.shared, self.entries), **self.fields)


def _as_list(values: list | np.ndarray) -> list:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)
