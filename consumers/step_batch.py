"""The batch of trainer step N, read back: the groups the trained log says the step trained, in its order.

On the cluster the step ran on, each group is read at its recorded place (partition, offset) and checked
against its recorded key. On a copy of the topics elsewhere (MirrorMaker, a restored backup) offsets differ
but keys and the trained log's records are copied as they are: a group whose place holds another key (or
nothing) is found by its ``prompt_uid``, the key of its record, in one scan of the groups topic. A step is
addressed by (run, step) in both cases.

The groups are decoded as ``BatchConsumer`` decodes them and converted by the backend's ``convert_groups``
with the policy version the step recorded: the same rows, the same tensors the trainer got.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from confluent_kafka import TopicPartition

from trajbus.consumers.group_records import decode_group
from trajbus.consumers.trained_log import TrainedLog, UnknownRun, choose_run
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.clients import reader
from trajbus.infra.topics import read_partition, watermarks
from trajbus.streams.client.chunks import ChunkReader
from trajbus.streams.wire.prefix import StructuredGroup
from trajbus.streams.wire.records import ReadyGroup, Step
from trajbus.streams.wire.topics import DEFAULT_PREFIX, groups_topic, validate_channel
from trajbus.streams.wire.trained import GroupRef, TrainedStep, effective_steps

log = logging.getLogger(__name__)

__all__ = ["StepBatchError", "StepBatches"]


class StepBatchError(ValueError):
    """A step that is not on record, or whose groups are gone; the message names which."""


class StepBatches:
    """Read the batch of a step of one channel's run (``run``: the only run on the trained log by default)."""

    def __init__(self, channel: str, bootstrap_servers: str | None = None, prefix: str = DEFAULT_PREFIX,
                 run: str | None = None, timeout: float = 30.0) -> None:
        self.channel = validate_channel(channel)
        self.bootstrap_servers = resolve_bootstrap_servers(bootstrap_servers)
        self.topic = groups_topic(channel, prefix)
        self.timeout = timeout
        trained = TrainedLog(self.bootstrap_servers, channel, prefix, timeout)
        records = trained.read()
        try:
            chosen = choose_run(records, run, trained.topic)
        except UnknownRun as exc:
            raise StepBatchError(str(exc)) from None
        if chosen is None:
            raise StepBatchError(f"run: no trainer recorded a step on {trained.topic} yet")
        self.run = chosen
        self.steps = {record.step: record for record in effective_steps(r for r in records if r.run == self.run)}
        self._consumer = reader(self.bootstrap_servers, {"group.id": f"{prefix}.step-batch.{uuid.uuid4().hex[:8]}",
                                                         "enable.partition.eof": True, "logger": log})
        self._chunks = ChunkReader(self.bootstrap_servers)

    def record(self, step: int) -> TrainedStep:
        if step not in self.steps:
            raise StepBatchError(f"step: run {self.run!r} has no step {step} on record (steps "
                                 f"{min(self.steps, default=0)}..{max(self.steps, default=0)})")
        return self.steps[step]

    def groups(self, step: int) -> list[StructuredGroup]:
        """The step's groups as the trainer decoded them, in the order it got them."""
        record = self.record(step)
        if any(ref.partition < 0 for ref in record.groups):
            raise StepBatchError(f"step {step}: its trainer ({record.trainer}) generated its groups itself; they "
                                 "are not on the groups topic")
        found = {ref: self._at_place(ref) for ref in record.groups}
        missing = [ref for ref, group in found.items() if group is None]
        if missing:
            found.update(self._by_key(missing))
        gone = [ref.prompt_uid for ref in record.groups if found.get(ref) is None]
        if gone:
            raise StepBatchError(f"step {step}: groups {', '.join(gone)} are no longer on {self.topic} "
                                 "(removed by retention?)")
        return [found[ref] for ref in record.groups]

    def ready_groups(self, step: int) -> list[ReadyGroup]:
        return [group.ready() for group in self.groups(step)]

    def step_records(self, step: int) -> list[Step]:
        """The steps of the batch, group after group (``ReadyGroup.steps`` order)."""
        return [s for group in self.ready_groups(step) for s in group.steps]

    def dataproto(self, step: int, backend: Any) -> Any:
        """The batch as ``backend`` (e.g. ``VerlBackend``) converted it for the trainer."""
        return backend.convert_groups(self.groups(step), self.record(step).policy_version)

    def samples(self, step: int, row_mode: str = "trajectory") -> list[Any]:
        """The batch as slime ``Sample``s (trajbus's where slime is absent): tokens, masks, log-probs and rewards
        as slime trains on them; the prompt fields a data source adds are not on the topics."""
        from trajbus.consumers.slime.samples import sample_kind, samples_from_group

        kind = sample_kind()
        samples = []
        for group in self.ready_groups(step):
            bases = []
            for index, _ in enumerate(group.trajectory_uids):
                base = kind.new()
                base.index, base.group_index, base.metadata = index, 0, {"prompt_uid": group.prompt_uid}
                bases.append(base)
            samples += samples_from_group(group.steps, bases, kind, row_mode)
        return samples

    def _at_place(self, ref: GroupRef) -> StructuredGroup | None:
        for message in read_partition(self._consumer, self.topic, ref.partition, ref.offset, ref.offset + 1):
            if (message.key() or b"").decode() == ref.prompt_uid:
                return decode_group(self._chunks, message.value())
        return None

    def _by_key(self, refs: list[GroupRef]) -> dict[GroupRef, StructuredGroup]:
        wanted = {ref.prompt_uid: ref for ref in refs}
        found: dict[GroupRef, StructuredGroup] = {}
        partitions = self._consumer.list_topics(self.topic, timeout=self.timeout).topics[self.topic].partitions
        for partition in sorted(partitions):
            start, end = watermarks(self._consumer, TopicPartition(self.topic, partition), self.timeout)
            for message in read_partition(self._consumer, self.topic, partition, start, end):
                ref = wanted.get((message.key() or b"").decode())
                if ref is not None:
                    found[ref] = decode_group(self._chunks, message.value())
        log.info("step batch found %d of %d groups by key (their places hold other records)", len(found), len(refs))
        return found

    def close(self) -> None:
        self._consumer.close()
        self._chunks.close()

    def __enter__(self) -> "StepBatches":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
