"""verl's prompts on trajbus's prompt ledger, found again after a resume by what stays the same.

verl's V1 trainer draws a fresh ``uuid4`` for every prompt it draws, so a prompt that the resumed
dataloader hands out again has a new ``uid``. What stays the same is the draw: the step that drew it and
its dataset ``index`` (verl's dataloader, restored from the checkpoint's ``data.pt``, draws the steps
after the checkpoint in the same order). A dispatch on the ledger records it: ``dataset`` is
``verl/{project}/{experiment}``, ``epoch`` the drawing step, ``offset`` the index, ``sample_indices``
``[k]`` for the k-th draw of that index at that step. In verl's async modes a prompt in flight at the
checkpoint is re-issued under its own ``uid``: it is found by that uid.

A prompt found is not generated again when the stream worker emitted its group: the outcome on the
ledger says where the group lies on the groups topic (``placed``). A run that crashed leaves dispatches
open; ``settle_previous`` abandons them first and waits until the worker has settled each (emitted if
its group was complete, else dropped), so every dispatch found has its final outcome.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

from trajbus.pipelines.ledger import PromptLedger
from trajbus.streams.wire.ledger import EMITTED, Dispatch, Outcome

__all__ = ["Draw", "Dispatches"]


@dataclass(frozen=True)
class Draw:
    """A prompt as verl's dataloader drew it: what a resume draws again."""

    step: int
    index: int
    occurrence: int = 0


class Dispatches:
    """The training channel's dispatches of one verl run, on its prompt ledger (module docstring)."""

    def __init__(self, ledger: PromptLedger, run: str) -> None:
        self.ledger = ledger
        self.dataset = f"verl/{run}"
        self.lock = threading.Lock()
        """The ledger's one reader and producer are shared by the trainer's thread and the feeder's."""
        self._by_draw: dict[Draw, Dispatch] = {}

    def settle_previous(self, timeout: float) -> None:
        """Abandon what a crashed run left open and wait for the worker's outcome of each."""
        with self.lock:
            self.ledger.settle_open("verl trainer restarted", timeout)
            for dispatch in self.ledger.view.dispatched.values():  # in ledger order: a later one wins
                if dispatch.dataset == self.dataset:
                    self._by_draw[self.draw_of(dispatch)] = dispatch

    @staticmethod
    def draw_of(dispatch: Dispatch) -> Draw:
        return Draw(dispatch.epoch, dispatch.offset, (dispatch.sample_indices or [0])[0])

    def find(self, uid: str, draw: Draw) -> Dispatch | None:
        """The latest dispatch of this prompt: by its ``uid`` (a re-issue keeps it), else by its draw."""
        with self.lock:
            view = self.ledger.view
            found = view.dispatched.get(uid) or self._by_draw.get(draw)
            while found is not None and found.prompt_uid in view.reissued:
                found = view.dispatched.get(view.reissued[found.prompt_uid])
            return found

    def emitted(self, dispatch: Dispatch) -> Outcome | None:
        """The outcome of a dispatch whose group is on the groups topic (its place known), else None."""
        with self.lock:
            outcome = self.ledger.view.outcomes.get(dispatch.prompt_uid)
        return outcome if outcome is not None and outcome.outcome == EMITTED and outcome.placed else None

    def record(self, uid: str, draw: Draw, n_rollouts: int, version: int,
               again: Dispatch | None = None) -> Dispatch:
        """A new dispatch (acknowledged): its prompt_uid is verl's uid, unless the ledger knows that uid
        already (a re-issue of a dispatch that was dropped: the worker settled that prompt_uid for good)."""
        with self.lock:
            prompt_uid = uid if uid not in self.ledger.view.dispatched else f"{uid}-{secrets.token_hex(3)}"
            dispatch = Dispatch(prompt_uid, self.ledger.channel, n_rollouts, self.dataset, draw.step, draw.index,
                                [draw.occurrence], version, "reissue" if again else "dataset",
                                again.prompt_uid if again else None)
            self.ledger.write([dispatch])
            self._by_draw[draw] = dispatch
            return dispatch
