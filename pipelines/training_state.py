"""What a trainer's checkpoint holds of trajbus: its position on the groups topic and the ledger's.

Save ``TrainingState.state_dict()`` in the same checkpoint as the model, and restore it with
the model. The consumer then resumes after the last group trained before the checkpoint
(groups emitted since are trained from the topic, once, against the restored model), and
the prompt ledger position lets the resume check that the ledger still holds what the
checkpoint relied on: a ledger that ends before it was deleted or replaced, and a ledger
of another dataset is refused. The data source resumes from the ledger itself
(``pipelines.data_source``), wherever its process crashed.

Each trainer step is recorded on the channel's trained log (``record_step``, acknowledged): which groups it
trained, where the consumer stood after it, and the policy version. ``state_dict`` records the groups handed
out and not yet recorded before it returns, so a checkpoint never exists without its batches on record; a
resume then trains again from the checkpoint's step, which the log's rewind rule reads as the older records
of those steps superseded (``streams.wire.trained``). ``trajbus audit`` and ``Replay.batch_of_step`` read it.
"""

from __future__ import annotations

from typing import Any

from trajbus.consumers.batch_consumer import BatchConsumer
from trajbus.consumers.trained_log import StepRecorder, TrainedLog
from trajbus.infra.outage import OUTAGE_LIMIT
from trajbus.pipelines.ledger import DEPTH, PromptLedger
from trajbus.streams.wire.ledger import LedgerError
from trajbus.streams.wire.trained import TrainedStep

__all__ = ["TrainingState"]


class TrainingState:
    """The consumer's position and the ledger's, saved and restored together, and each step on record.

    ``run`` names the run on the trained log (default: the consumer's group id, one per experiment)."""

    def __init__(self, consumer: BatchConsumer, ledger: PromptLedger, run: str | None = None) -> None:
        if consumer.channel != ledger.channel:
            raise ValueError(f"ledger: of channel {ledger.channel!r}, the consumer reads {consumer.channel!r}")
        self.consumer, self.ledger = consumer, ledger
        # a step's write rides through an outage as long as the consumer's fetches do
        self.trained = TrainedLog(consumer.bootstrap_servers, consumer.channel, consumer.prefix,
                                  consumer.outage_limit or OUTAGE_LIMIT)
        self.recorder = StepRecorder(self.trained, run or consumer.group_id, "batch_consumer", consumer.topic,
                                     consumer.rank)
        consumer.on_handed_out = self.recorder.handed_out

    @property
    def step(self) -> int:
        """The last step recorded (or restored from the checkpoint)."""
        return self.recorder.last_step

    def record_step(self, step: int | None = None, policy_version: int | None = None,
                    only: list[str] | None = None) -> TrainedStep:
        """Record the groups handed out since the last step as trainer step ``step`` (the next by default):
        call it once the step's groups went into its update, before a checkpoint of it is saved. ``only``:
        the prompt_uids it trained, in its order, where it passed some over (``StepRecorder.step_done``)."""
        return self.recorder.step_done(self.consumer.state_dict()["positions"], step, policy_version, only)

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint; groups handed out and not yet on record are recorded first (as the next
        step), and the ledger depth is measured on the way."""
        if self.recorder.pending:
            self.record_step()
        self.depth()
        return {"consumer": self.consumer.state_dict(),
                "ledger": {"topic": self.ledger.topic, "offset": self.ledger.position,
                           "dataset": self.ledger.view.dataset},
                "trained": {"run": self.recorder.run, "step": self.recorder.last_step}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["ledger"]
        if saved["topic"] != self.ledger.topic:
            raise LedgerError(f"ledger: the checkpoint was saved on {saved['topic']}, this trainer reads "
                              f"{self.ledger.topic}")
        self.ledger.refresh()
        if self.ledger.position < saved["offset"]:
            raise LedgerError(f"ledger: {self.ledger.topic} ends at {self.ledger.position}, the checkpoint saw "
                              f"{saved['offset']} records: it was deleted or replaced")
        if saved["dataset"] is not None:
            self.ledger.view.check_dataset(saved["dataset"])
        self.consumer.load_state_dict(state["consumer"])
        self.recorder.forget_pending()
        self.recorder.last_step = state.get("trained", {}).get("step", 0)

    def depth(self) -> int:
        """Prompt groups dispatched and not yet trained (``trajbus_ledger_depth``)."""
        self.ledger.refresh()
        positions = {int(p): o for p, o in self.consumer.state_dict()["positions"].items()}
        depth = self.ledger.view.untrained(positions)
        DEPTH.labels(self.ledger.channel).set(depth)
        return depth

    def close(self) -> None:
        """Close the trained log's producer (the consumer and the ledger are their owner's to close)."""
        self.trained.close()

    def __enter__(self) -> "TrainingState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
