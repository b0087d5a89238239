"""What a trainer's checkpoint holds of trajbus: its position on the groups topic and the ledger's.

Save ``TrainingState.state_dict()`` in the same checkpoint as the model, and restore it with
the model. The consumer then resumes after the last group trained before the checkpoint
(groups emitted since are trained from the topic, once, against the restored model), and
the prompt ledger position lets the resume check that the ledger still holds what the
checkpoint relied on: a ledger that ends before it was deleted or replaced, and a ledger
of another dataset is refused. The data source resumes from the ledger itself
(``pipelines.data_source``), wherever its process crashed.
"""

from __future__ import annotations

from typing import Any

from trajbus.consumers.batch_consumer import BatchConsumer
from trajbus.pipelines.ledger import DEPTH, PromptLedger
from trajbus.streams.wire.ledger import LedgerError

__all__ = ["TrainingState"]


class TrainingState:
    """The consumer's position and the ledger's, saved and restored together."""

    def __init__(self, consumer: BatchConsumer, ledger: PromptLedger) -> None:
        if consumer.channel != ledger.channel:
            raise ValueError(f"ledger: of channel {ledger.channel!r}, the consumer reads {consumer.channel!r}")
        self.consumer, self.ledger = consumer, ledger

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint; the ledger depth is measured on the way."""
        self.depth()
        return {"consumer": self.consumer.state_dict(),
                "ledger": {"topic": self.ledger.topic, "offset": self.ledger.position,
                           "dataset": self.ledger.view.dataset}}

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

    def depth(self) -> int:
        """Prompt groups dispatched and not yet trained (``trajbus_ledger_depth``)."""
        self.ledger.refresh()
        positions = {int(p): o for p, o in self.consumer.state_dict()["positions"].items()}
        depth = self.ledger.view.untrained(positions)
        DEPTH.labels(self.ledger.channel).set(depth)
        return depth
