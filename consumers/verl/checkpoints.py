"""Where the trainer's checkpoints stand in the queue: the read position at each policy version.

verl's fully-async trainer takes ``R = ppo_mini_batch_size * require_batches`` samples per step and
moves to the next policy version every ``T = trigger_parameter_sync_step`` steps; it checkpoints only
at a new version (``global_step_{version}``) and resumes at one. So the queue needs no hook in verl's
trainer: it counts the samples it hands out, and when a version's ``T * R``-th sample goes out it
records ``version -> position`` (acknowledged, on a compacted topic beside the samples) before
returning that sample. A resume looks up the checkpoint verl's trainer will load (the same rule,
``find_latest_ckpt_path``) and starts reading at the position recorded for its version: samples
handed out after that checkpoint are handed out again, those before it never.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from confluent_kafka import TopicPartition

from trajbus.infra.clients import acked_producer, reader
from trajbus.infra.topics import read_partition, watermarks
from trajbus.streams.client.delivery import produce_acked

log = logging.getLogger(__name__)

Position = dict[str, Any]
"""A queue's read position: each source's own (``{"samples": offset, "groups": {partition: offset}}``)."""


def resume_version(config: Any) -> int | None:
    """The policy version verl's trainer will resume from (0: none saved yet), or None when the run
    starts afresh (``resume_mode: disable``): the rule of ``FullyAsyncTrainer.load_checkpoint``."""
    trainer = config.trainer
    mode = trainer.get("resume_mode", "auto")
    if mode == "disable":
        return None
    if mode == "resume_path":
        folder = trainer.resume_from_path
    else:
        from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

        folder = find_latest_ckpt_path(os.path.abspath(trainer.default_local_dir))
        if folder is None:
            return 0
    return int(str(folder).rstrip("/").split("global_step_")[-1])


@dataclass
class VersionClock:
    """Counts samples handed out and says when one ends a policy version."""

    samples_per_version: int
    version: int = 0
    handed_out: int = 0

    @classmethod
    def of(cls, config: Any, version: int) -> "VersionClock":
        actor = config.actor_rollout_ref.actor
        batches = config.async_training.get("require_batches", 1)
        steps = config.async_training.get("trigger_parameter_sync_step", 1)
        return cls(int(actor.ppo_mini_batch_size) * int(batches) * int(steps), version)

    def tick(self) -> int | None:
        """One sample handed out: the version it completes, if it completes one."""
        self.handed_out += 1
        if self.handed_out % self.samples_per_version:
            return None
        self.version += 1
        return self.version


class CheckpointPositions:
    """``version -> position`` records on ``{topic}.positions`` (one compacted partition)."""

    def __init__(self, bootstrap_servers: str, topic: str, timeout: float = 60.0) -> None:
        self.topic = topic
        self.timeout = timeout
        self._bootstrap = bootstrap_servers
        self._producer = acked_producer(bootstrap_servers, {"logger": log})

    def load(self) -> dict[int, Position]:
        """Every version's recorded position (the newest record of each)."""
        probe = reader(self._bootstrap, {"logger": log, "enable.partition.eof": True})
        try:
            partition = TopicPartition(self.topic, 0)
            start, end = watermarks(probe, partition, self.timeout)
            recorded: dict[int, Position] = {}
            for message in read_partition(probe, self.topic, 0, start, end):
                if message.value() is not None:
                    recorded[int(message.key())] = json.loads(message.value())
            return recorded
        finally:
            probe.close()

    def record(self, version: int, position: Position) -> None:
        """Acknowledged before the sample that ends ``version`` is handed out."""
        produce_acked(self._producer, self.topic, [(str(version).encode(), json.dumps(position).encode(), [])],
                      self.timeout)

    def close(self) -> None:
        self._producer.flush(self.timeout)
