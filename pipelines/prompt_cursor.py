"""Where a prompt data source stands in its dataset, and the groups it copies from there.

``PromptCursor`` walks the dataset as slime's data source does: in order, crossing an epoch boundary
inside a call, each epoch in the order ``rollout_seed + epoch`` seeds when ``rollout_shuffle`` (so any
position can be rebuilt: a resume re-issues a prompt from its epoch and offset alone); each group is
``n_samples_per_prompt`` independent copies of one prompt with fresh global indices.
"""

from __future__ import annotations

from typing import Any

from trajbus.consumers.slime.sample import Sample
from trajbus.consumers.slime.sample_kind import SampleKind
from trajbus.pipelines.prompt_dataset import PromptDataset

__all__ = ["PromptCursor"]


class PromptCursor:
    """The dataset (None without ``rollout_global_dataset``), ``epoch_id``, ``sample_offset`` and the next
    ``sample_index``."""

    def __init__(self, args: Any, kind: SampleKind) -> None:
        self.args, self.kind = args, kind
        self.dataset = PromptDataset(args) if args.rollout_global_dataset else None
        self.epoch_id = 0
        self.sample_offset = 0
        self.sample_index = 0
        self.move_to(0, 0, 0)

    @property
    def identity(self) -> str:
        """The dataset as the prompt ledger names it (``none/0`` without one)."""
        return self.dataset.identity if self.dataset is not None else "none/0"

    @property
    def position(self) -> tuple[int, int, int]:
        """``(epoch_id, sample_offset, sample_index)``: what ``move_to`` takes back."""
        return self.epoch_id, self.sample_offset, self.sample_index

    def move_to(self, epoch_id: int, sample_offset: int, sample_index: int) -> None:
        """Stand there, the dataset in that epoch's order."""
        self.epoch_id, self.sample_offset, self.sample_index = epoch_id, sample_offset, sample_index
        if self.dataset is not None and self.args.rollout_shuffle:
            self.dataset.shuffle(epoch_id)

    def take(self, num_samples: int) -> list[tuple[list[Sample], int, int]]:
        """``num_samples`` groups, each with the epoch and offset of its prompt (offset -1 without a dataset)."""
        if self.dataset is None:
            return [(self._copies(None), self.epoch_id, -1) for _ in range(num_samples)]
        taken: list[tuple[list[Sample], int, int]] = []
        while len(taken) < num_samples:
            count = min(num_samples - len(taken), len(self.dataset) - self.sample_offset)
            for offset in range(self.sample_offset, self.sample_offset + count):
                taken.append((self._copies(self.dataset.samples[offset]), self.epoch_id, offset))
            self.sample_offset += count
            if self.sample_offset == len(self.dataset) and len(taken) < num_samples:
                self.move_to(self.epoch_id + 1, 0, self.sample_index)  # the boundary is crossed inside this call
        return taken

    def _copies(self, prompt: Sample | None) -> list[Sample]:
        """``n_samples_per_prompt`` copies; ``group_index`` counts groups, as slime's (first index // n)."""
        group, group_index = [], self.sample_index // self.args.n_samples_per_prompt
        for _ in range(self.args.n_samples_per_prompt):
            sample = self.kind.new(prompt)
            sample.index, sample.group_index = self.sample_index, group_index
            self.sample_index += 1
            group.append(sample)
        return group

    def regroup(self, epoch: int, offset: int, sample_indices: list[int]) -> list[Sample]:
        """The group once taken at ``epoch``/``offset``, with its sample indices again (a re-issue)."""
        prompt = None
        if self.dataset is not None and offset >= 0:
            prompt = (self.dataset.order(epoch) if self.args.rollout_shuffle else self.dataset.origin_samples)[offset]
        group = [self.kind.new(prompt) for _ in sample_indices]
        for sample, index in zip(group, sample_indices):
            sample.index, sample.group_index = index, sample_indices[0] // len(sample_indices)
        return group

    def __len__(self) -> int:
        """The prompts of one epoch (0 without a dataset)."""
        return len(self.dataset) if self.dataset is not None else 0
