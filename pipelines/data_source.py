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

A data source owns its parts and orders them: its ``cursor`` in the dataset
(``pipelines.prompt_cursor``), its ``dispatcher`` on the ledger
(``pipelines.dispatcher``) and, with a buffer, its ``group_buffer``
(``pipelines.group_buffer``).

Settings use slime's argument names (``prompt_data``, ``input_key``,
``label_key``, ``metadata_key``, ``tool_key``, ``apply_chat_template``,
``rollout_max_prompt_len``, ``n_samples_per_prompt``, ``rollout_shuffle``,
``rollout_seed``, ``save``, ``load``, ``buffer_filter_path``), so an
``argparse.Namespace`` from slime works as well as ``DataSourceArgs``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajbus.consumers.slime.sample import Sample, Status
from trajbus.consumers.slime.sample_kind import TRAJBUS_SAMPLES, SampleKind
from trajbus.pipelines.dispatcher import Dispatcher, Picked, Settling
from trajbus.pipelines.group_buffer import GroupBuffer, aborted_groups, pop_first
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.prompt_cursor import PromptCursor
from trajbus.pipelines.prompt_dataset import PromptDataset, read_records
from trajbus.streams.wire.ledger import Dispatch

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


def _state_path(directory: str | Path, rollout_id: int) -> Path:
    return Path(directory) / "rollout" / f"global_dataset_state_dict_{rollout_id}.json"


class RolloutDataSource:
    """Read-only prompt groups from a dataset, epoch after epoch; on a ``ledger``, recorded and resumable.
    ``kind``: the ``Sample`` class handed out (trajbus's; slime's for a data source inside slime);
    ``settling``: who settles the groups it gives up (``dispatcher.WorkerSettles``, the stream worker, by default)."""

    group_buffer: GroupBuffer | None = None
    """Groups served before the dataset: none here; ``RolloutDataSourceWithBuffer`` sets its own first."""

    def __init__(self, args: Any, ledger: PromptLedger | None = None, kind: SampleKind = TRAJBUS_SAMPLES, *,
                 settling: Settling | None = None) -> None:
        self.args, self.kind, self.ledger = args, kind, ledger
        self.metadata: dict[str, Any] = {}
        self.cursor = PromptCursor(args, kind)
        self.dataset = self.cursor.dataset
        self.dispatcher = Dispatcher(ledger, self.cursor.identity, kind, settling)
        if ledger is not None:
            self._roll_forward()

    @property
    def epoch_id(self) -> int:
        return self.cursor.epoch_id

    @property
    def sample_offset(self) -> int:
        return self.cursor.sample_offset

    @property
    def sample_index(self) -> int:
        return self.cursor.sample_index

    @property
    def due(self) -> list[Dispatch]:
        """Dispatches abandoned at the resume, handed out again before anything else."""
        return self.dispatcher.due

    def _roll_forward(self) -> None:
        """The cursor after the last prompt dispatched, the next sample index and the buffer, as the ledger
        has them."""
        view = self.ledger.view
        epoch, offset, index = self.cursor.position
        if view.last_from_dataset is not None:
            epoch, offset = view.last_from_dataset.epoch, view.last_from_dataset.offset + 1
        self.cursor.move_to(epoch, offset, max(index, view.max_sample_index + 1))
        if self.group_buffer is not None:
            self.group_buffer.restore(view.buffer())

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """``num_samples`` groups of ``n_samples_per_prompt`` independent copies (abandoned ones first).
        On a ledger, all of them are recorded in one acknowledged write; if it fails, nothing moved."""
        position, due = self.cursor.position, list(self.dispatcher.due)
        picked = self._pick(num_samples)
        try:
            self.dispatcher.record([dispatch for _, dispatch in picked])
        except BaseException:
            self.cursor.move_to(*position)
            self.dispatcher.due = due
            if self.group_buffer is not None:
                self.group_buffer.put_back([(group, d.origin) for group, d in picked
                                            if d is not None and d.source == "buffer"])
            raise
        return [group for group, _ in picked]

    def _pick(self, num_samples: int) -> list[Picked]:
        """The groups abandoned at the resume, then the buffer's (through its filter), then the dataset's."""
        picked = self.dispatcher.again(num_samples, self.cursor)
        if self.group_buffer is not None and len(self.group_buffer):
            now = self.cursor.epoch_id
            picked += [self.dispatcher.stamp(group, "buffer", now, -1, entry)
                       for group, entry in self.group_buffer.take(num_samples - len(picked))]
        return picked + [self.dispatcher.stamp(group, "dataset", epoch, offset)
                         for group, epoch, offset in self.cursor.take(num_samples - len(picked))]

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError(f"{type(self).__name__} is read-only: use RolloutDataSourceWithBuffer to add samples")

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch_id": self.epoch_id, "sample_offset": self.sample_offset, "sample_index": self.sample_index,
                 "metadata": self.metadata}
        if self.group_buffer is not None:
            state["buffer"] = self.group_buffer.records()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved state; on a ledger, its cursor then moves on to where the ledger stands, and the ledger's
        buffer replaces the file's (whose groups may have been taken since)."""
        if self.group_buffer is not None:
            self.group_buffer.load(state.get("buffer", []))
        self.cursor.move_to(state["epoch_id"], state["sample_offset"], state["sample_index"])
        self.metadata = dict(state["metadata"])
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
        return len(self.cursor)


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """The buffer first (aborted or returned groups), then the dataset. ``filter_args``: what the buffer
    filter gets as its ``args`` (slime's own, inside slime; ``args`` by default)."""

    def __init__(self, args: Any, ledger: PromptLedger | None = None, kind: SampleKind = TRAJBUS_SAMPLES, *,
                 settling: Settling | None = None, filter_args: Any = None) -> None:
        self.group_buffer = GroupBuffer(args, kind, filter_args)  # a bad buffer_filter_path fails first
        super().__init__(args, ledger, kind, settling=settling)

    @property
    def buffer(self) -> list[list[Sample]]:
        """The buffered groups, oldest first: the list the buffer filter takes from, as slime's."""
        return self.group_buffer.groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Append groups to the buffer; each must be a list of ``n_samples_per_prompt`` Samples."""
        self.group_buffer.check(samples)
        self.group_buffer.add(samples, self.dispatcher.buffered(samples))

    def return_aborted(self, groups: list[list[Sample]]) -> int:
        """Partial rollouts cut off (status ``aborted``) go back to the buffer, responses kept; returns how many."""
        aborted = aborted_groups(groups, self.kind)
        self.add_samples(aborted)
        return len(aborted)

    def get_buffer_length(self) -> int:
        return len(self.group_buffer)
