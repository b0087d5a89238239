"""Prompt data sources with slime's semantics: ``RolloutDataSource(WithBuffer)``.

A user moving from slime keeps the behaviour their training relies on:

- ``get_samples(num)`` returns ``num`` groups of ``n_samples_per_prompt``
  independent copies of one prompt, each with a fresh global ``index``;
- the dataset is walked in order and an epoch boundary is crossed inside a
  call; with ``rollout_shuffle`` each epoch's order is a permutation of the
  original order seeded by ``rollout_seed + epoch`` (deterministic, resumable);
- ``save(rollout_id)`` / ``load(rollout_id)`` keep ``epoch_id``,
  ``sample_offset``, ``sample_index`` and metadata, so a resumed run continues
  exactly where the saved one was;
- ``RolloutDataSourceWithBuffer`` serves its buffer first (through a buffer
  filter chosen by dotted path, default pop-first), then the dataset; aborted
  partial rollouts go back to the buffer. Beyond slime, the buffer is saved and
  restored with the rest of the state.

Given a ``PromptLedger`` (``pipelines.ledger``), every group handed out is first
recorded on Kafka, acknowledged, under its ``prompt_uid`` (``Sample.prompt_uid``),
and so is every group added to the buffer. A data source built on a ledger that
already holds records resumes from it, whatever file was loaded: the cursor
continues after the last prompt dispatched, the buffer is as it was, and the
prompts dispatched but never settled by the worker are abandoned and handed out
again first, exactly once, under new uids (those the worker had already emitted
are trained from the groups topic instead). A ledger of another dataset is refused.

Settings use slime's argument names (``prompt_data``, ``input_key``,
``label_key``, ``metadata_key``, ``tool_key``, ``apply_chat_template``,
``rollout_max_prompt_len``, ``n_samples_per_prompt``, ``rollout_shuffle``,
``rollout_seed``, ``save``, ``load``, ``buffer_filter_path``), so an
``argparse.Namespace`` from slime works as well as ``DataSourceArgs``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.prompt_dataset import PromptDataset, read_records
from trajbus.pipelines.sample_kind import TRAJBUS_SAMPLES, SampleKind
from trajbus.pipelines.samples import Sample, Status
from trajbus.streams.wire.ledger import BufferEntry, Dispatch
from trajbus.streams.worker.settings import import_dotted

__all__ = ["DataSourceArgs", "PromptDataset", "RolloutDataSource", "RolloutDataSourceWithBuffer", "Sample", "Status",
           "pop_first", "read_records"]


@dataclass
class DataSourceArgs:
    """slime's data-source arguments, with its names and defaults."""

    prompt_data: str | None = None
    input_key: str = "text"
    label_key: str | None = None
    metadata_key: str = "metadata"
    tool_key: str | None = None
    apply_chat_template: bool = False
    apply_chat_template_kwargs: dict[str, Any] | None = None
    tokenizer_path: str | None = None
    rollout_max_prompt_len: int | None = None
    n_samples_per_prompt: int = 1
    rollout_global_dataset: bool = True
    rollout_shuffle: bool = False
    rollout_seed: int = 42
    save: str | None = None
    load: str | None = None
    buffer_filter_path: str | None = None


def _next_attempt(prompt_uid: str) -> str:
    """The uid a re-issue of ``prompt_uid`` gets: ``<first uid>~<attempt>``."""
    first, _, attempt = prompt_uid.partition("~")
    return f"{first}~{int(attempt or 0) + 1}"


def _state_path(directory: str | Path, rollout_id: int) -> Path:
    return Path(directory) / "rollout" / f"global_dataset_state_dict_{rollout_id}.json"


class RolloutDataSource:
    """Read-only prompt groups from a dataset, epoch after epoch; on a ``ledger``, recorded and resumable.
    ``kind``: the ``Sample`` class handed out (trajbus's; slime's for a data source inside slime)."""

    def __init__(self, args: Any, ledger: PromptLedger | None = None, kind: SampleKind = TRAJBUS_SAMPLES) -> None:
        self.args = args
        self.kind = kind
        self.epoch_id = 0
        self.sample_offset = 0
        self.sample_index = 0
        self.metadata: dict[str, Any] = {}
        self.dataset = PromptDataset(args) if args.rollout_global_dataset else None
        if self.dataset is not None and args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)
        self.ledger = ledger
        self.dataset_id = self.dataset.identity if self.dataset is not None else "none/0"
        self.due: list[Dispatch] = []
        """Dispatches abandoned at the resume, handed out again before anything else."""
        if ledger is not None:
            ledger.provision()
            ledger.refresh()
            ledger.view.check_dataset(self.dataset_id)
            self.due = self._settle_left_open()
            self._roll_forward()

    def _settle_left_open(self) -> list[Dispatch]:
        """The dispatches a crashed run left open, given up; returns those to hand out again. Here the
        stream worker settles each (its group may already be on the groups topic)."""
        return self.ledger.settle_open(why="data source resumed")

    def _roll_forward(self) -> None:
        """The cursor after the last prompt dispatched, and the next sample index, as the ledger has them."""
        view = self.ledger.view
        if view.last_from_dataset is not None:
            self.epoch_id, self.sample_offset = view.last_from_dataset.epoch, view.last_from_dataset.offset + 1
            if self.dataset is not None and self.args.rollout_shuffle:
                self.dataset.shuffle(self.epoch_id)
        self.sample_index = max(self.sample_index, view.max_sample_index + 1)

    def _copies(self, prompt: Sample | None) -> list[Sample]:
        """``n_samples_per_prompt`` copies; ``group_index`` counts groups, as slime's (first index // n)."""
        group, group_index = [], self.sample_index // self.args.n_samples_per_prompt
        for _ in range(self.args.n_samples_per_prompt):
            sample = self.kind.new(prompt)
            sample.index, sample.group_index = self.sample_index, group_index
            self.sample_index += 1
            group.append(sample)
        return group

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """``num_samples`` groups of ``n_samples_per_prompt`` independent copies (abandoned ones first).
        On a ledger, all of them are recorded in one acknowledged write; if it fails, nothing moved."""
        cursor, due = (self.epoch_id, self.sample_offset, self.sample_index), list(self.due)
        picked = self._again(num_samples)
        picked += self._new_groups(num_samples - len(picked))
        try:
            self._record([dispatch for _, dispatch in picked])
        except BaseException:
            (self.epoch_id, self.sample_offset, self.sample_index), self.due = cursor, due
            self._put_back([(group, d) for group, d in picked if d is not None and d.source == "buffer"])
            raise
        return [group for group, _ in picked]

    def _put_back(self, taken: list[tuple[list[Sample], Dispatch]]) -> None:
        """Buffered groups taken by a call that failed (none without a buffer)."""

    def _new_groups(self, num_samples: int) -> list[tuple[list[Sample], Dispatch | None]]:
        """Groups from the dataset, each with its dispatch record (None without a ledger)."""
        if self.dataset is None:
            return [self._dispatchable(self._copies(None), "dataset", -1) for _ in range(num_samples)]
        picked: list[tuple[list[Sample], Dispatch | None]] = []
        while len(picked) < num_samples:
            take = min(num_samples - len(picked), len(self.dataset) - self.sample_offset)
            for offset in range(self.sample_offset, self.sample_offset + take):
                picked.append(self._dispatchable(self._copies(self.dataset.samples[offset]), "dataset", offset))
            self.sample_offset += take
            if self.sample_offset == len(self.dataset) and len(picked) < num_samples:
                self.epoch_id += 1  # the boundary is crossed inside this call
                self.sample_offset = 0
                if self.args.rollout_shuffle:
                    self.dataset.shuffle(self.epoch_id)
        return picked

    def _dispatchable(self, group: list[Sample], source: str, offset: int, origin: str | None = None,
                      epoch: int | None = None) -> tuple[list[Sample], Dispatch | None]:
        """A group and the dispatch that will record it; its samples carry the new prompt_uid."""
        if self.ledger is None:
            return group, None
        epoch = self.epoch_id if epoch is None else epoch
        if source == "reissue":
            prompt_uid = _next_attempt(origin)
        elif source == "buffer":
            prompt_uid = f"b{origin or uuid.uuid4().hex[:16]}"
        else:  # a dataset position names the prompt; without a dataset, its first sample does
            prompt_uid = f"p{self.dataset_id[:8]}-e{epoch}-o{offset}" if offset >= 0 else f"s{group[0].index}"
        for sample in group:
            sample.prompt_uid = prompt_uid
        return group, Dispatch(prompt_uid, self.ledger.channel, len(group), self.dataset_id, epoch, offset,
                               [s.index for s in group], self.ledger.policy_version(), source, origin)

    def _again(self, num_samples: int) -> list[tuple[list[Sample], Dispatch | None]]:
        """Up to ``num_samples`` of the groups abandoned at the resume, as re-issues."""
        taken, self.due = self.due[:num_samples], self.due[num_samples:]
        picked = []
        for dispatch in taken:
            root = self.ledger.view.root(dispatch.prompt_uid)
            if root.source == "buffer":
                group = [self.kind.restore(s) for s in self.ledger.view.buffered[root.origin]]
            else:
                prompt = self._prompt_at(root.epoch, root.offset)
                group = [self.kind.new(prompt) for _ in root.sample_indices]
                for sample, index in zip(group, root.sample_indices):
                    sample.index, sample.group_index = index, root.sample_indices[0] // len(root.sample_indices)
            picked.append(self._dispatchable(group, "reissue", root.offset, dispatch.prompt_uid, root.epoch))
        return picked

    def _prompt_at(self, epoch: int, offset: int) -> Sample | None:
        if self.dataset is None or offset < 0:
            return None
        return (self.dataset.order(epoch) if self.args.rollout_shuffle else self.dataset.origin_samples)[offset]

    def _record(self, dispatches: list[Dispatch | None]) -> None:
        """Every group handed out is on the ledger, acknowledged, before any agent starts on it."""
        if self.ledger is not None and dispatches:
            self.ledger.write(dispatches)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError(f"{type(self).__name__} is read-only: use RolloutDataSourceWithBuffer to add samples")

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_id": self.epoch_id, "sample_offset": self.sample_offset, "sample_index": self.sample_index,
                "metadata": self.metadata}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved state; on a ledger, its cursor then moves on to where the ledger stands."""
        self.epoch_id, self.sample_offset = state["epoch_id"], state["sample_offset"]
        self.sample_index, self.metadata = state["sample_index"], dict(state["metadata"])
        if self.dataset is not None and self.args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)
        if self.ledger is not None:
            self._roll_forward()

    def save(self, rollout_id: int) -> Path | None:
        """Write the state of ``rollout_id`` under ``args.save``; returns the file."""
        if not self.args.save:
            return None
        path = _state_path(self.args.save, rollout_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state_dict()))
        tmp.replace(path)
        return path

    def load(self, rollout_id: int | None = None) -> bool:
        """Restore the state saved for ``rollout_id`` under ``args.load``; False if there is none."""
        if not self.args.load or rollout_id is None:
            return False
        path = _state_path(self.args.load, rollout_id)
        if not path.exists():
            return False
        self.load_state_dict(json.loads(path.read_text()))
        return True

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict[str, Any]:
        return self.metadata

    def __len__(self) -> int:
        """The prompts of one epoch (0 without a dataset), as slime's: its trainer counts rollouts by it."""
        return len(self.dataset) if self.dataset is not None else 0


BufferFilter = Callable[[Any, Any, list[list[Sample]], int], list[list[Sample]]]


def pop_first(args: Any, rollout_id: Any, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """slime's default buffer filter: the oldest groups first."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """The buffer first (aborted or returned groups), then the dataset."""

    def __init__(self, args: Any, ledger: PromptLedger | None = None, kind: SampleKind = TRAJBUS_SAMPLES) -> None:
        self.buffer: list[list[Sample]] = []
        self._entries: dict[int, str] = {}
        """On a ledger: id() of a buffered group -> its buffer entry."""
        path = getattr(args, "buffer_filter_path", None)
        self.buffer_filter: BufferFilter = import_dotted(path, "buffer_filter_path") if path else pop_first
        if not callable(self.buffer_filter):
            raise ValueError(f"buffer_filter_path: {path!r} is not callable")
        self.filter_args: Any = args
        """What the buffer filter gets as its ``args`` (slime's own, inside slime)."""
        super().__init__(args, ledger, kind)

    def _put_back(self, taken: list[tuple[list[Sample], Dispatch]]) -> None:
        self.buffer[:0] = [group for group, _ in taken]
        self._entries.update({id(group): dispatch.origin for group, dispatch in taken if dispatch.origin})

    def _roll_forward(self) -> None:
        super()._roll_forward()
        buffered = self.ledger.view.buffer()
        self.buffer = [[self.kind.restore(s) for s in samples] for samples in buffered.values()]
        self._entries = {id(group): entry for group, entry in zip(self.buffer, buffered)}

    def _new_groups(self, num_samples: int) -> list[tuple[list[Sample], Dispatch | None]]:
        """The buffer first (through the buffer filter), then the dataset."""
        taken = self.buffer_filter(self.filter_args, None, self.buffer, num_samples) if self.buffer else []
        picked = [self._dispatchable(g, "buffer", -1, self._entries.pop(id(g), None)) for g in taken]
        if len(picked) < num_samples:
            picked += super()._new_groups(num_samples - len(picked))
        return picked

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Append groups to the buffer; each must be a list of ``n_samples_per_prompt`` Samples."""
        if not isinstance(samples, list):
            raise ValueError(f"samples: expected a list of groups, got {type(samples).__name__}")
        for position, group in enumerate(samples):
            if not isinstance(group, list) or not all(self.kind.is_sample(s) for s in group):
                raise ValueError(f"samples[{position}]: a group is a list of Sample")
            if len(group) != self.args.n_samples_per_prompt:
                raise ValueError(f"samples[{position}]: has {len(group)} samples, n_samples_per_prompt is "
                                 f"{self.args.n_samples_per_prompt}")
        if self.ledger is not None:  # a group returned from a dispatch replaces it: that one is given up
            entries = [BufferEntry(uuid.uuid4().hex[:16], [self.kind.record(s) for s in group],
                                   getattr(group[0], "prompt_uid", None) if group else None) for group in samples]
            self.ledger.write(entries)
            self._give_up([entry.replaces for entry in entries if entry.replaces], "returned to the buffer")
            self._entries.update({id(group): entry.entry_id for group, entry in zip(samples, entries)})
        self.buffer.extend(samples)

    def _give_up(self, prompt_uids: list[str], why: str) -> None:
        """Dispatches whose groups went back to the buffer: the stream worker drops them unless emitted."""
        if prompt_uids:
            self.ledger.abandon(prompt_uids, why)

    def return_aborted(self, groups: list[list[Sample]]) -> int:
        """Partial rollouts cut off (status ``aborted``) go back to the buffer, responses kept; returns how many."""
        aborted = [g for g in groups if any(s.status == self.kind.status.ABORTED for s in g)]
        self.add_samples(aborted)
        return len(aborted)

    def get_buffer_length(self) -> int:
        return len(self.buffer)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "buffer": [[self.kind.record(s) for s in g] for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved buffer; on a ledger, the ledger's replaces it (the file's may have been taken since)."""
        self.buffer = [[self.kind.restore(s) for s in g] for g in state.get("buffer", [])]
        self._entries = {}
        super().load_state_dict(state)
