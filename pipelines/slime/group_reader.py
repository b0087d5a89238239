"""The agentic rollout's reader of its channel's groups topic, its position kept in slime's checkpoint.

slime saves its data source's state with each checkpoint (``save(rollout_id)``: the cursor and its
``metadata`` dict, in slime's data source and trajbus's alike) and loads the checkpoint's on a resume
(``load(start_rollout_id - 1)``). The reader keeps where it stands in that dict, under
``STATE_KEY``: after each rollout, the position after the last group the rollout took. Loaded
again, it reads on from there, so the groups emitted after the checkpoint (taken by a rollout whose
training the loaded model never saw, or never taken) are read again, once. With a prompt ledger the
state is a ``TrainingState`` (the ledger's position and dataset are checked on the way back), and the
groups the ledger says were emitted at or after the position are ``waiting``: they are in flight as
far as the rollout is concerned, so it dispatches that many fewer.

Every partition's position is kept, those never read from included (the consumer group's commit, else
the log start): a partition missing from a saved position would resume at the group's last commit,
which may be past groups never trained.
"""

from __future__ import annotations

import logging
from typing import Any

from trajbus.consumers.batch_consumer import BatchConsumer
from trajbus.infra.group_lag import consumer_group_lag
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.training_state import TrainingState
from trajbus.streams.wire.ledger import EMITTED
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import ReadyGroup

__all__ = ["GroupReader", "STATE_KEY"]

log = logging.getLogger("trajbus.slime")

STATE_KEY = "trajbus_groups"
"""The key of the data source's ``metadata`` that holds the reader's position."""


class GroupReader:
    """Ready groups of one channel, FIFO by readiness, from the position the data source's state holds."""

    def __init__(self, bootstrap_servers: str, prefix: str, channel: str, ledger: PromptLedger | None = None) -> None:
        with StepProducer(bootstrap_servers, prefix=prefix) as producer:
            producer.provision(channel)  # the gateway refuses a channel whose topics do not exist
        self.channel, self.ledger = channel, ledger
        self.consumer = BatchConsumer(channel, bootstrap_servers, prefix=prefix, rank=0, world_size=1)
        self.training_state = TrainingState(self.consumer, ledger) if ledger is not None else None
        start = consumer_group_lag(bootstrap_servers, self.consumer.group_id, self.consumer.topic)
        self.consumer.load_state_dict({"topic": self.consumer.topic,
                                       "positions": {lag.partition: lag.position for lag in start}})
        self.saved: Any = None
        """The state last written to or loaded from the data source's metadata."""
        self.waiting: set[str] = set()
        """prompt_uids the ledger says were emitted at or after the position, not read yet."""
        self._count_waiting()

    def resume(self, metadata: dict[str, Any] | None, running: set[str] = frozenset()) -> bool:
        """Read on from the position ``metadata`` holds when it is not the one this reader left there
        (slime loaded a checkpoint); ``running``: prompt_uids dispatched by this process, not waiting."""
        saved = (metadata or {}).get(STATE_KEY)
        if saved is None or saved == self.saved:
            return False
        if self.training_state is not None:
            self.training_state.load_state_dict(saved)
        else:
            self.consumer.load_state_dict(saved["consumer"])
        self.saved = saved
        self._count_waiting(running)
        log.info("agentic rollout: channel %s resumes at the checkpoint's groups position, %d groups emitted "
                 "since are read again", self.channel, len(self.waiting))
        return True

    def _count_waiting(self, running: set[str] = frozenset()) -> None:
        if self.ledger is None:
            return
        self.ledger.refresh()
        positions = self.consumer.state_dict()["positions"]
        self.waiting = {uid for uid, outcome in self.ledger.view.outcomes.items()
                        if outcome.outcome == EMITTED and outcome.placed is not None and uid not in running
                        and outcome.placed[1] >= positions.get(outcome.placed[0], 0)}

    def next(self, timeout: float) -> ReadyGroup | None:
        group = self.consumer.fetch_group(timeout)
        if group is not None:
            self.waiting.discard(group.prompt_uid)
        return group

    def save(self, metadata: dict[str, Any] | None, rollout_id: int | None = None,
             trained: list[str] | None = None) -> None:
        """Where the reader stands into ``metadata`` (saved with slime's checkpoint), and committed. On a
        ledger, the rollout is first a step on the trained log: ``trained``, the prompt_uids of its batch
        in the batch's order (the groups read and passed over are not)."""
        if self.training_state is not None and rollout_id is not None:
            self.training_state.record_step(rollout_id, rollout_id, trained)
        state = self.training_state.state_dict() if self.training_state is not None else \
            {"consumer": self.consumer.state_dict()}
        if metadata is not None:
            metadata[STATE_KEY] = state
        self.saved = state
        self.consumer.commit()

    def close(self) -> None:
        if self.training_state is not None:
            self.training_state.close()
        self.consumer.close()
