"""A data source's buffer: groups handed back (aborted, surplus, returned), served before the dataset.

The groups are taken through a buffer filter chosen as slime chooses it (``buffer_filter_path``, by
default ``pop_first``: the oldest first), called as slime calls it: ``filter(args, rollout_id, buffer,
num_samples)`` takes the groups out of ``buffer`` and returns them. On a prompt ledger each buffered group
is an entry there; the buffer remembers which, so that the group's next dispatch names its entry.
"""

from __future__ import annotations

from typing import Any, Callable

from trajbus.consumers.slime.sample import Sample
from trajbus.consumers.slime.sample_kind import SampleKind
from trajbus.infra.dotted import import_dotted

__all__ = ["BufferFilter", "GroupBuffer", "aborted_groups", "pop_first"]

BufferFilter = Callable[[Any, Any, list[list[Sample]], int], list[list[Sample]]]


def pop_first(args: Any, rollout_id: Any, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """slime's default buffer filter: the oldest groups first."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


def aborted_groups(groups: list[list[Any]], kind: SampleKind) -> list[list[Any]]:
    """The partial rollouts among ``groups``: those with a sample cut off (status ``aborted``)."""
    return [g for g in groups if any(s.status == kind.status.ABORTED for s in g)]


class GroupBuffer:
    """The buffered ``groups``, oldest first, and the ledger entry of each (by ``id()``)."""

    def __init__(self, args: Any, kind: SampleKind, filter_args: Any = None) -> None:
        self.args, self.kind = args, kind
        self.groups: list[list[Sample]] = []
        """The list the buffer filter takes from (slime's ``buffer``)."""
        path = getattr(args, "buffer_filter_path", None)
        self.buffer_filter: BufferFilter = import_dotted(path, "buffer_filter_path") if path else pop_first
        if not callable(self.buffer_filter):
            raise ValueError(f"buffer_filter_path: {path!r} is not callable")
        self.filter_args: Any = args if filter_args is None else filter_args
        """What the buffer filter gets as its ``args`` (slime's own, inside slime)."""
        self._entries: dict[int, str] = {}
        """On a ledger: id() of a buffered group -> its buffer entry."""

    def check(self, samples: Any) -> None:
        """``ValueError`` unless ``samples`` is a list of groups of ``n_samples_per_prompt`` Samples."""
        if not isinstance(samples, list):
            raise ValueError(f"samples: expected a list of groups, got {type(samples).__name__}")
        for position, group in enumerate(samples):
            if not isinstance(group, list) or not all(self.kind.is_sample(s) for s in group):
                raise ValueError(f"samples[{position}]: a group is a list of Sample")
            if len(group) != self.args.n_samples_per_prompt:
                raise ValueError(f"samples[{position}]: has {len(group)} samples, n_samples_per_prompt is "
                                 f"{self.args.n_samples_per_prompt}")

    def add(self, groups: list[list[Sample]], entries: list[str | None]) -> None:
        """Append ``groups``, each with its ledger entry (None without a ledger)."""
        self._entries.update({id(group): entry for group, entry in zip(groups, entries) if entry is not None})
        self.groups.extend(groups)

    def take(self, num_samples: int) -> list[tuple[list[Sample], str | None]]:
        """Groups through the buffer filter (asked for ``num_samples``), each with its ledger entry."""
        taken = self.buffer_filter(self.filter_args, None, self.groups, num_samples)
        return [(group, self._entries.pop(id(group), None)) for group in taken]

    def put_back(self, taken: list[tuple[list[Sample], str | None]]) -> None:
        """Groups ``take`` gave out that were not handed out after all: first again."""
        self.groups[:0] = [group for group, _ in taken]
        self._entries.update({id(group): entry for group, entry in taken if entry})

    def restore(self, buffered: dict[str, list[dict[str, Any]]]) -> None:
        """The buffer as the ledger has it: entry -> its samples' records."""
        self.groups = [[self.kind.restore(s) for s in samples] for samples in buffered.values()]
        self._entries = {id(group): entry for group, entry in zip(self.groups, buffered)}

    def records(self) -> list[list[dict[str, Any]]]:
        """The groups as JSON records, for the saved state."""
        return [[self.kind.record(s) for s in group] for group in self.groups]

    def load(self, records: list[list[dict[str, Any]]]) -> None:
        """The groups of a saved state (its ledger entries unknown)."""
        self.groups = [[self.kind.restore(s) for s in group] for group in records]
        self._entries = {}

    def __len__(self) -> int:
        return len(self.groups)
