"""slime's ``--data-source-path``: ``trajbus.pipelines.slime.SlimeDataSource``, on trajbus's prompt ledger.

slime builds its data source as ``load_function(args.data_source_path)(args)`` (``RolloutManager``)
and calls ``get_samples``, ``add_samples``, ``save``, ``load`` and ``len()`` on it. This one hands
out slime's own ``Sample`` (trajbus's, with the same fields, where slime is not installed), keeps
slime's semantics through the ``RolloutDataSourceWithBuffer`` it owns (``pipelines.data_source``:
order, seeded reshuffle per epoch, buffer first through ``--buffer-filter-path``), and, given a broker
(``pipelines.slime.settings``), records every group on the prompt ledger before slime sees it. What
slime itself loses, it keeps:

- the buffer is on the ledger, so it survives a crash without a checkpoint;
- with ``--rollout-function-path trajbus.pipelines.slime.sglang.generate_rollout`` each rollout is
  settled (``pipelines.slime.settle``): surplus over-sampled groups and aborted ones go back to the
  buffer instead of being lost, filtered ones are recorded with their reason, trained ones with the
  rollout that trained them, and the rollout is a step on the trained log (``trajbus audit``): its
  groups by prompt_uid, since slime generated them itself (they are not on the groups topic);
- ``load(rollout_id)`` hands out again, first and once, every group trained after that checkpoint
  (its training is not in the model slime loads) and every group a crashed run left in flight; the
  cursor goes on after the last group handed out, whatever file was loaded.

Without that rollout function, a checkpoint counts every group handed out before it as consumed (as
slime's cursor does) and a resume re-issues those handed out after it. With ``trajbus_settled_by:
worker`` (rollouts through trajbus's gateway) the stream worker records each group instead, as for
every trajbus data source. Without a broker it is slime's data source, plus the saved buffer.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

from trajbus.consumers.slime.samples import sample_kind
from trajbus.consumers.trained_log import StepRecorder, TrainedLog
from trajbus.pipelines.data_source import RolloutDataSourceWithBuffer
from trajbus.pipelines.group_buffer import aborted_groups
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.slime.rollout_args import dynamic_filter
from trajbus.pipelines.slime.settings import SlimeSettings, source_args
from trajbus.pipelines.slime.settle import InFlight, SettledGroups, leaves, settle_groups
from trajbus.streams.wire.ledger import ABANDONED, DROPPED, EMITTED, Dispatch, Outcome
from trajbus.streams.wire.topics import trainer_group_id
from trajbus.streams.wire.trained import GroupRef

__all__ = ["SlimeDataSource"]

log = logging.getLogger("trajbus.slime")


class RolloutSettles:
    """``trajbus_settled_by: rollout``: this data source, told by the rollout function, records how each group
    ended, not the stream worker; a group given up is dropped at once."""

    def left_open(self, ledger: PromptLedger) -> list[Dispatch]:
        """The groups a crashed run left in flight are lost with it: recorded as abandoned, issued again."""
        left_open = ledger.view.open()
        if left_open:
            ledger.write([Outcome(d.prompt_uid, DROPPED, ABANDONED) for d in left_open])
            log.info("trajbus data source: %d groups left in flight by the last run are handed out again",
                     len(left_open))
        return ledger.view.due_again()

    def give_up(self, ledger: PromptLedger, prompt_uids: list[str], why: str) -> None:
        ledger.write([Outcome(uid, DROPPED, why) for uid in prompt_uids])


SOURCE_POSITION = frozenset({"epoch_id", "sample_offset", "sample_index", "due"})


class SlimeDataSource:
    """slime's data source (``__init__(args)``, ``get_samples``, ``add_samples``, ``save``, ``load``, ``len``)
    on trajbus's prompt ledger. Thread-safe: slime's fully-async rollout calls it from its own thread. It owns
    the ``RolloutDataSourceWithBuffer`` (``source``) that hands out and buffers the groups, and settles them."""

    def __init__(self, args: Any) -> None:
        self.settings = SlimeSettings.from_args(args)
        self.slime_args = args
        self.rollout_id: int | None = None
        """The rollout being generated (``begin_rollout``): each dispatch is stamped with it as its policy version."""
        self.in_flight: dict[int, InFlight] = {}
        """id(group) -> a group handed out since ``begin_rollout`` and not settled."""
        self._lock = threading.RLock()
        self._settles = self.settings.settled_by == "rollout"
        """True when this data source, told by the rollout function, records how each group ended."""
        ledger = self.settings.open_ledger(policy_version=lambda: self.rollout_id)
        try:
            self.source = RolloutDataSourceWithBuffer(source_args(args), ledger=ledger, kind=sample_kind(),
                                                      settling=RolloutSettles() if self._settles else None,
                                                      filter_args=args)
        except BaseException:
            if ledger is not None:
                ledger.close()
            raise
        self.args, self.kind, self.dataset = self.source.args, self.source.kind, self.source.dataset
        self.ledger = ledger
        self.recorder: StepRecorder | None = None
        if ledger is not None and self._settles:
            trained = TrainedLog(ledger.bootstrap_servers, ledger.channel, ledger.prefix)
            self.recorder = StepRecorder(trained, trainer_group_id(ledger.channel, ledger.prefix), "slime", "")
        where = f"ledger {ledger.topic} (settled by {self.settings.settled_by})" if ledger else "no ledger"
        log.info("trajbus data source: %s, %d prompts, %s, %d groups due again, %d buffered", self.kind.name,
                 len(self), where, len(self.source.due), self.get_buffer_length())

    def __getattr__(self, name: str) -> Any:
        """Where the source stands (``epoch_id``, ``sample_offset``, ``sample_index``, ``due``), as slime's own
        data source has it: rollout functions written for slime read them."""
        if name in SOURCE_POSITION:
            return getattr(self.source, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def metadata(self) -> dict[str, Any]:
        """The source's metadata, saved with its state (the agentic rollout keeps its reader's position there)."""
        return self.source.metadata

    @property
    def buffer(self) -> list[list[Any]]:
        """The buffered groups, oldest first (the source's)."""
        return self.source.buffer

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        with self._lock:
            groups = self.source.get_samples(num_samples)
            if self.rollout_id is not None and self._settles:
                for group in groups:
                    self.in_flight[id(group)] = InFlight(group, copy.deepcopy(group),
                                                         getattr(group[0], "prompt_uid", None) if group else None)
            return groups

    def add_samples(self, samples: list[list[Any]]) -> None:
        """Groups back to the buffer (slime's partial rollout returns its aborted ones here)."""
        with self._lock:
            self.source.add_samples(samples)
            returned = list(leaves(samples))
            ids, indices = {id(s) for s in returned}, {s.index for s in returned if s.index is not None}
            for key, flight in list(self.in_flight.items()):
                if any(id(s) in ids or s.index in indices for s in flight.group):
                    del self.in_flight[key]

    def return_aborted(self, groups: list[list[Any]]) -> int:
        """Partial rollouts cut off (status ``aborted``) go back to the buffer, responses kept; returns how many."""
        aborted = aborted_groups(groups, self.kind)
        self.add_samples(aborted)
        return len(aborted)

    def get_buffer_length(self) -> int:
        return self.source.get_buffer_length()

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        self.source.update_metadata(metadata)

    def get_metadata(self) -> dict[str, Any]:
        return self.source.get_metadata()

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved state; on a ledger, the cursor and the buffer then are where the ledger has them."""
        self.source.load_state_dict(state)

    def begin_rollout(self, rollout_id: int) -> None:
        """Groups handed out from now on belong to ``rollout_id`` until ``settle``."""
        if not self._settles:
            raise RuntimeError("begin_rollout: with trajbus_settled_by=worker the stream worker records each group")
        with self._lock:
            self.rollout_id = rollout_id

    def settle(self, trained: Any) -> SettledGroups:
        """End the rollout: ``trained`` is the batch it returned (``RolloutFnTrainOutput.samples``). Every
        group it took is recorded as trained or filtered, or goes back to the buffer (surplus, aborted).
        Groups handed out after it, until the next ``begin_rollout``, are not tracked (nor stamped)."""
        if not self._settles:
            raise RuntimeError("settle: with trajbus_settled_by=worker the stream worker records each group")
        with self._lock:
            settled = settle_groups(list(self.in_flight.values()), trained, self.kind.status,
                                    dynamic_filter(self.slime_args))
            self.in_flight.clear()
            rollout_id, self.rollout_id = self.rollout_id, None
            if self.ledger is not None:
                records = [Outcome(f.prompt_uid, EMITTED) for f in settled.trained if f.prompt_uid]
                records += [Outcome(f.prompt_uid, DROPPED, why) for f, why in settled.filtered if f.prompt_uid]
                if records:
                    self.ledger.write(records)
            if self.recorder is not None and rollout_id is not None:
                self.recorder.write([GroupRef(-1, -1, f.prompt_uid) for f in settled.trained if f.prompt_uid], {},
                                    rollout_id, rollout_id)
            back = [f.group for f in settled.surplus] + [f.pristine for f in settled.aborted]
            if back:
                self.add_samples(back)
            log.info("trajbus data source: rollout %s settled: %s", rollout_id, settled.summary())
            return settled

    def save(self, rollout_id: int) -> Any:
        """The saved state of ``rollout_id``. On a ledger, groups handed out and never settled (no settling
        rollout function) are recorded as consumed before this checkpoint, as slime's cursor counts them."""
        with self._lock:
            if self.ledger is not None and self._settles:
                tracked = {f.prompt_uid for f in self.in_flight.values()}
                consumed = [Outcome(d.prompt_uid, EMITTED) for d in self.ledger.view.open()
                            if d.prompt_uid not in tracked]
                if consumed:
                    self.ledger.write(consumed)
            return self.source.save(rollout_id)

    def load(self, rollout_id: int | None = None) -> bool:
        """The state saved for ``rollout_id`` (slime calls ``load(start_rollout_id - 1)``); on a ledger, the
        groups trained after that rollout are handed out again first, once."""
        with self._lock:
            loaded = self.source.load(rollout_id)
            if self.ledger is not None and self._settles and rollout_id is not None:
                self._hand_out_again_after(rollout_id)
            return loaded

    def _hand_out_again_after(self, rollout_id: int) -> None:
        """Groups trained in a rollout after ``rollout_id``: the model slime loads never learnt from them."""
        view, dispatcher = self.ledger.view, self.source.dispatcher
        due = {d.prompt_uid for d in dispatcher.due}
        lost = [d for uid, d in view.dispatched.items()
                if d.policy_version is not None and d.policy_version > rollout_id and uid not in due
                and uid not in view.reissued and getattr(view.outcomes.get(uid), "outcome", None) == EMITTED]
        if lost:
            order = {uid: position for position, uid in enumerate(view.dispatched)}
            dispatcher.due = sorted([*dispatcher.due, *lost], key=lambda d: order[d.prompt_uid])
            log.info("trajbus data source: %d groups trained after rollout %d (not in its checkpoint) are handed "
                     "out again first", len(lost), rollout_id)

    def __len__(self) -> int:
        """The prompts of one epoch (0 without a dataset): slime's trainer counts rollouts by it."""
        return len(self.source)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.log.close()
        if self.ledger is not None:
            self.ledger.close()
