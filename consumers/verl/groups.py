"""trajbus's ready prompt groups as verl's rollout samples (``TRAJBUS_VERL_QUEUE=groups``).

Agents that went through trajbus's gateway produce prompt groups; verl's fully-async trainer takes
``ray.cloudpickle``d ``RolloutSample``s, one per prompt, whose ``full_batch`` is what verl's agent loop
returns for the prompt's ``n`` rollouts. ``GroupSamples`` reads the groups with a ``BatchConsumer`` and
lays each out as verl's rollouter would, so verl's own ``assemble_batch_from_rollout_samples`` and
GRPO take it unchanged:

- tensors: ``VerlBackend``'s (prompts, responses, input_ids, attention_mask, response_mask,
  position_ids, rm_scores, rollout_log_probs where the engine gave them) and trajbus's
  ``token_policy_version`` / ``token_staleness``;
- ``uid`` = ``uid_{prompt_uid}`` on every row (verl's ``uid_{sample_id}``: what GRPO groups by);
  ``min_global_steps`` / ``max_global_steps``: the oldest and newest policy version that sampled a
  token of the row; ``__num_turns__``, ``turn_scores``, ``tool_rewards``, and ``extras`` (the row's
  step metadata, in one column: every sample must have the same columns to be concatenated);
  trajbus's ``trajectory_uid``, ``step_index``, ``policy_version``, ``staleness``;
- ``meta_info`` exactly verl's keys: ``metrics`` (one dict per row, ``addition_process`` reads
  ``generate_sequences`` and ``tool_calls``) and ``reward_extra_keys``; anything that differs between
  samples would fail ``DataProto.concat``.

Each policy version the trainer completes is a step on the trained log (``trajbus audit``,
``trajbus replay --step N``), numbered as verl numbers its checkpoints (``global_step_N``), with the
groups handed out for it in their order; the run is ``verl.{project_name}.{experiment_name}``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

import numpy as np
import ray
from confluent_kafka import KafkaException, TopicPartition
from verl import DataProto
from verl.experimental.fully_async_policy.detach_utils import RolloutSample

from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.batch_consumer import BatchConsumer, rank_partitions
from trajbus.consumers.rows import Row
from trajbus.consumers.trained_log import StepRecorder, TrainedLog
from trajbus.consumers.verl.checkpoints import resume_version
from trajbus.consumers.verl.settings import VerlQueueSettings
from trajbus.infra.clients import reader
from trajbus.infra.topics import ensure_topics, watermarks
from trajbus.streams.client.policy import PolicyVersionPublisher
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.prefix import StructuredGroup

log = logging.getLogger(__name__)

UID_PREFIX = "uid_"
KEPT = {"uid", "trajectory_uid", "step_index", "policy_version", "staleness"}
"""``VerlBackend``'s non-tensor columns that every sample has; step metadata goes into ``extras``."""


def pad_token_id(model_path: Any) -> int:
    """The id verl's trainer pads with (its tokenizer's pad, else EOS, as verl's ``hf_tokenizer`` sets it),
    or 0 when the tokenizer cannot be loaded here: padding is masked out, only its filler differs."""
    try:
        from transformers import AutoTokenizer

        path = str(model_path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=not os.path.isdir(path))
    except Exception as exc:  # noqa: BLE001 - any failure means "not loadable here"
        log.warning("tokenizer of %s not loadable (%s): padding with id 0", model_path, exc)
        return 0
    return next((int(i) for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)


def objects(values: Iterable[Any]) -> np.ndarray:
    """A 1-d object column (lists stay elements: ``np.array`` would make them a dimension)."""
    values = list(values)
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def sampled_versions(row: Row) -> np.ndarray:
    """The policy versions of the tokens the model sampled (the row's oldest step's if it sampled none)."""
    if row.versions is None:
        return np.array([s.policy_version for s in row.steps])
    versions = np.asarray(row.versions)[np.asarray(row.response_mask, dtype=bool)]
    return versions if versions.size else np.array([min(s.policy_version for s in row.steps)])


def metrics(row: Row) -> dict[str, Any]:
    """verl's ``AgentLoopMetrics`` of a row. trajbus records when each step was written, not how long the
    engine took: ``generate_sequences`` is the span from the row's first to its last step (0.0 for one
    call), ``tool_calls`` 0.0 (tools run in the agent, unseen)."""
    span = max(0.0, row.steps[-1].created_at - row.steps[0].created_at)
    return {"generate_sequences": span, "tool_calls": 0.0, "compute_score": 0.0, "num_preempted": -1}


def rollout_batch(batch: DataProto, rows: list[Row], prompt_uid: str) -> DataProto:
    """``VerlBackend``'s batch of one group, laid out as verl's rollouter's ``full_batch`` (module docstring)."""
    columns = batch.non_tensor_batch
    for key in set(columns) - KEPT:
        del columns[key]
    versions = [sampled_versions(row) for row in rows]
    columns.update({
        "uid": objects(f"{UID_PREFIX}{prompt_uid}" for _ in rows),
        "min_global_steps": objects(int(v.min()) for v in versions),
        "max_global_steps": objects(int(v.max()) for v in versions),
        "__num_turns__": np.array([2 * len(row.steps) for row in rows], dtype=np.int32),  # verl's 2k for k calls
        "turn_scores": objects([] for _ in rows),
        "tool_rewards": objects([] for _ in rows),
        "extras": objects(dict(row.steps[-1].metadata) for row in rows),
    })
    batch.meta_info = {"metrics": [metrics(row) for row in rows], "reward_extra_keys": []}
    return batch


class RolloutBackend(VerlBackend):
    """``VerlBackend`` whose batch of one group is a ``RolloutSample``'s ``full_batch``."""

    def convert_groups(self, groups: list[StructuredGroup], current_version: int | None = None) -> DataProto:
        if len(groups) != 1:
            raise ValueError(f"groups: a rollout sample is one prompt group, got {len(groups)}")
        rows = self.structured_rows(groups)
        return rollout_batch(self.batch(rows, current_version), rows, groups[0].prompt_uid)


class GroupSamples:
    """A ``SampleSource`` (``queue.SampleSource``): the ready groups of one channel, a ``RolloutSample`` each."""

    def __init__(self, bootstrap_servers: str, settings: VerlQueueSettings, config: Any) -> None:
        topics = TopicSettings(prefix=settings.prefix)  # verl may start before any agent: provision as the gateway
        ensure_topics(bootstrap_servers, topics.shared_specs() + topics.channel_specs(settings.channel))
        backend = RolloutBackend(int(config.data.max_prompt_length), int(config.data.max_response_length),
                                 pad_token_id(config.actor_rollout_ref.model.get("path")), row_mode=settings.row_mode)
        self.consumer = BatchConsumer(settings.channel, bootstrap_servers, prefix=settings.prefix, backend=backend)
        self.topic = self.consumer.topic
        self._probe = reader(bootstrap_servers, {"group.id": self.consumer.group_id, "logger": log})  # never joins
        self._publisher = PolicyVersionPublisher(bootstrap_servers, settings.prefix, settings.channel)
        self._partitions: list[int] | None = None
        self.version = resume_version(config) or 0
        """The trainer's policy version: what the staleness of the samples handed out is measured against."""
        self.taken = 0
        run = settings.samples_topic(config).removeprefix(f"{settings.prefix}.")
        self.recorder = StepRecorder(TrainedLog(bootstrap_servers, settings.channel, settings.prefix), run, "verl",
                                     self.topic)
        self.recorder.last_step = self.version
        self.consumer.on_handed_out = self.recorder.handed_out

    def partitions(self) -> list[int]:
        if self._partitions is None:  # the groups topic's, asked once (trajbus never changes a topic's count)
            self._partitions = rank_partitions(self._probe, self.topic, 0, 1)
        return self._partitions

    def _bounds(self, partition: int) -> tuple[int, int]:
        return watermarks(self._probe, TopicPartition(self.topic, partition), 30.0)

    def take(self, timeout: float) -> bytes | None:
        batch = self.consumer.fetch_dataproto(1, timeout, self.version)
        if batch is None:
            return None
        self.taken += 1
        status = {"count/total_generated_samples": self.taken, "monitor/queue/mq_queue_size": self.backlog()}
        sample_id = str(batch.non_tensor_batch["uid"][0])[len(UID_PREFIX):]
        return ray.cloudpickle.dumps(RolloutSample(full_batch=batch, sample_id=sample_id, epoch=0,
                                                   rollout_status=status))

    def backlog(self) -> int:
        """Ready groups not yet handed out: per partition, the log end minus the position."""
        positions = self.where()
        waiting = 0
        for p in self.partitions():
            low, high = self._bounds(p)
            waiting += max(0, high - max(positions.get(str(p), low), low))
        return waiting

    def where(self) -> dict[str, int]:
        """Per partition (a string: JSON), the offset after the last group handed out."""
        return {str(p): int(o) for p, o in self.consumer.state_dict()["positions"].items()}

    def resume(self, where: dict) -> None:
        self.consumer.load_state_dict({"topic": self.topic, "positions": where})

    def from_start(self) -> None:
        """The trainer group's commits (else the log start), written down for every partition: a checkpoint's
        position must name each, or a partition not yet read would resume at a commit made after it."""
        parts = self.partitions()
        committed = self._probe.committed([TopicPartition(self.topic, p) for p in parts], timeout=30)
        starts = {tp.partition: tp.offset for tp in committed}
        self.resume({p: max(starts.get(p, -1), self._bounds(p)[0]) for p in parts})

    def begin_fresh(self) -> None:
        """Groups wait for a trainer whatever its checkpoints: a fresh run trains those not yet committed."""
        self.from_start()

    def end(self) -> dict[str, int]:
        return {str(p): self._bounds(p)[1] for p in self.partitions()}

    def skip_to(self, end: dict) -> None:
        """Hand out nothing before ``end`` (never moves back)."""
        positions = self.where()
        self.resume({**positions, **{str(p): max(int(o), positions.get(str(p), 0)) for p, o in end.items()}})

    def version_ended(self, version: int) -> None:
        """Commit (a new run of the experiment starts there) and publish the trainer's version for the
        channel: the gateway's admission paces staleness by it. First the version's groups go on the
        trained log, acknowledged: before the trainer can checkpoint the step."""
        self.recorder.step_done(self.consumer.state_dict()["positions"], version, version - 1)
        try:
            self.consumer.commit()
        except KafkaException as exc:  # the checkpoint's recorded position is what a resume reads
            log.warning("commit of %s failed: %s", self.topic, exc)
        self._publisher.publish(version)
        self.version = version

    def close(self) -> None:
        self.recorder.log.close()
        self.consumer.close()
        self._probe.close()
        self._publisher.close()
