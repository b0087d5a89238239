"""How each group a slime rollout took ended: the rule ``SlimeDataSource.settle`` applies.

slime's sglang rollout over-samples: it takes ``over_sampling_batch_size`` groups at a time, keeps
the first ``rollout_batch_size`` that finish and pass the dynamic filter, and aborts the rest when
the batch is full. Of the groups it took, each is then exactly one of:

- **trained**: a sample of it is in the batch the rollout returned (matched by identity, ``index``
  or ``prompt_uid``, so a rollout that builds new Samples is still matched);
- **surplus**: every sample finished (completed or truncated, with a reward) and the dynamic filter
  keeps it, but the batch was already full: slime drops it, trajbus puts it back in the buffer, where
  slime's rollout takes a finished sample as it is, without generating it again;
- **filtered**: finished, and the dynamic filter (``--dynamic-sampling-filter-path``, asked again
  with the same group) drops it, with its reason;
- **aborted**: not finished (cut off by the abort, or never started): slime drops it unless
  ``--partial-rollout`` returned it (then it is no longer in flight); trajbus puts the group back in
  the buffer as it was handed out, so the prompt is issued again, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterator

from trajbus.pipelines.slime.rollout_args import DynamicFilterVerdict

Keep = Callable[[list[Any]], DynamicFilterVerdict]
"""slime's dynamic sampling filter on a group (``rollout_args.dynamic_filter``)."""


@dataclass
class InFlight:
    """A group handed out during a rollout and not settled yet."""

    group: list[Any]
    """The samples handed out: slime's rollout fills them in place."""
    pristine: list[Any]
    """Copies as handed out: what goes back to the buffer when the group is aborted."""
    prompt_uid: str | None


@dataclass
class SettledGroups:
    """The groups of one rollout by how each ended (the module docstring's four cases)."""

    trained: list[InFlight] = field(default_factory=list)
    surplus: list[InFlight] = field(default_factory=list)
    filtered: list[tuple[InFlight, str]] = field(default_factory=list)
    aborted: list[InFlight] = field(default_factory=list)

    def summary(self) -> str:
        reasons = sorted({reason for _, reason in self.filtered})
        return (f"{len(self.trained)} trained, {len(self.surplus)} surplus and {len(self.aborted)} aborted back "
                f"to the buffer, {len(self.filtered)} filtered" + (f" ({', '.join(reasons)})" if reasons else ""))


def leaves(node: Any) -> Iterator[Any]:
    """The samples of a rollout's output, however deeply nested in lists."""
    if isinstance(node, (list, tuple)):
        for item in node:
            yield from leaves(item)
    elif node is not None:
        yield node


def finished(group: list[Any], status: type[Enum]) -> bool:
    """Every sample completed or truncated, with its reward: slime's rollout would take it as it is."""
    return all(s.status in (status.COMPLETED, status.TRUNCATED) and s.reward is not None for s in group)


def settle_groups(in_flight: list[InFlight], trained: Any, status: type[Enum], keep: Keep) -> SettledGroups:
    """Each group of ``in_flight`` as trained, surplus, filtered or aborted (see the module docstring)."""
    samples = list(leaves(trained))
    ids = {id(s) for s in samples}
    indices = {s.index for s in samples if getattr(s, "index", None) is not None}
    uids = {uid for s in samples if (uid := getattr(s, "prompt_uid", None)) is not None}
    settled = SettledGroups()
    for flight in in_flight:
        if flight.prompt_uid in uids or any(id(s) in ids or s.index in indices for s in flight.group):
            settled.trained.append(flight)
        elif finished(flight.group, status):
            verdict = keep(flight.group)
            kept, reason = verdict.keep, verdict.reason
            if kept:
                settled.surplus.append(flight)
            else:
                settled.filtered.append((flight, f"filtered: {reason or 'dynamic sampling filter'}"))
        else:
            settled.aborted.append(flight)
    return settled
