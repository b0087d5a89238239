"""A channel's trained log on Kafka (``streams.wire.trained``): trainers append a record per step, acknowledged;
the audit and ``Replay.batch_of_step`` read it to its end.

Every reader a trainer uses writes here through ``StepRecorder``: it collects the groups handed out since the
last step (topic, partition, offset, key) and writes them as one step when the trainer says the step is done.
"""

from __future__ import annotations

import logging
from confluent_kafka import Producer, TopicPartition

from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.clients import acked_producer, reader
from trajbus.infra.topics import ensure_topics, read_partition, watermarks
from trajbus.streams.client.delivery import produce_acked
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.headers import content_type_headers
from trajbus.streams.wire.topics import DEFAULT_PREFIX, trained_topic, validate_channel
from trajbus.streams.wire.trained import CONTENT_TYPE, GroupRef, TrainedStep, decode_trained, encode_trained

log = logging.getLogger("trajbus.trained")

__all__ = ["GrowingSteps", "StepRecorder", "TrainedLog", "UnknownRun", "choose_run"]


class UnknownRun(ValueError):
    """A run the trained log does not hold, or no run named where it holds several; the text lists them."""


def choose_run(records: list[TrainedStep], run: str | None, topic: str) -> str | None:
    """The run to read: the one named, else the only one on the log (None: no step recorded yet)."""
    runs = list(dict.fromkeys(record.run for record in records))
    if run is not None:
        if run not in runs:
            raise UnknownRun(f"run: {run!r} recorded no step on {topic}; runs there: {', '.join(runs) or 'none'}")
        return run
    if len(runs) > 1:
        raise UnknownRun(f"run: {topic} holds several runs, name one with --run: {', '.join(runs)}")
    return runs[0] if runs else None


class TrainedLog:
    """One channel's trained log: ``write`` appends acknowledged, ``read`` returns every record to the end now."""

    def __init__(self, bootstrap_servers: str | None = None, channel: str = "train", prefix: str = DEFAULT_PREFIX,
                 timeout: float = 30.0) -> None:
        self.channel = validate_channel(channel)
        self.settings = TopicSettings(prefix=prefix)
        self.topic = trained_topic(channel, prefix)
        self.bootstrap_servers = resolve_bootstrap_servers(bootstrap_servers)
        self.timeout = timeout
        self._producer: Producer | None = None

    def write(self, record: TrainedStep) -> None:
        """Append one step, and return once every in-sync replica has it (the topic is made on first use)."""
        if self._producer is None:
            ensure_topics(self.bootstrap_servers, [self.settings.trained_spec(self.channel)], self.timeout)
            self._producer = acked_producer(self.bootstrap_servers, {"logger": log})
        key, value = encode_trained(record)
        produce_acked(self._producer, self.topic, [(key, value, content_type_headers(CONTENT_TYPE))],
                      self.timeout)
        log.info("trained step recorded run=%s step=%d groups=%d", record.run, record.step, len(record.groups))

    def read(self) -> list[TrainedStep]:
        """Every record up to the log's end now, in log order (none when no trainer recorded a step yet)."""
        consumer = reader(self.bootstrap_servers, {"enable.partition.eof": True, "logger": log})
        try:
            if self.topic not in consumer.list_topics(timeout=self.timeout).topics:
                return []
            start, end = watermarks(consumer, TopicPartition(self.topic, 0), self.timeout)
            return [decode_trained(message.value()) for message in read_partition(consumer, self.topic, 0, start, end)]
        finally:
            consumer.close()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(self.timeout)
            self._producer = None


class StepRecorder:
    """The groups a reader handed out since its last step, written as a step when the trainer says so."""

    def __init__(self, trained_log: TrainedLog, run: str, trainer: str, groups_topic: str, rank: int = 0) -> None:
        self.log, self.run, self.trainer, self.topic, self.rank = trained_log, run, trainer, groups_topic, rank
        self.pending: list[GroupRef] = []
        self.last_step = 0
        """The number of the last step recorded (0: none yet, or restored from a checkpoint)."""

    def handed_out(self, partition: int, offset: int, prompt_uid: str) -> None:
        self.pending.append(GroupRef(partition, offset, prompt_uid))

    def step_done(self, positions: dict[int, int], step: int | None = None, policy_version: int | None = None,
                  only: list[str] | None = None) -> TrainedStep:
        """Record the pending groups as step ``step`` (the one after the last by default), acknowledged.
        ``only``: the prompt_uids the step trained, in the order it trained them (the other groups handed
        out were passed over: filtered, not this trainer's)."""
        groups = list(self.pending)
        if only is not None:
            by_uid = {group.prompt_uid: group for group in groups}
            groups = [by_uid[uid] for uid in only]
        record = self.write(groups, positions, step, policy_version)
        self.pending.clear()
        return record

    def write(self, groups: list[GroupRef], positions: dict[int, int], step: int | None = None,
              policy_version: int | None = None) -> TrainedStep:
        """Record ``groups`` as step ``step`` (the one after the last by default), acknowledged."""
        step = self.last_step + 1 if step is None else step
        record = TrainedStep(self.run, step, self.topic, groups, dict(positions), self.trainer, policy_version,
                             self.rank)
        self.log.write(record)
        self.last_step = step
        return record

    def forget_pending(self) -> None:
        """A resume from a checkpoint: what was handed out since is handed out again, not trained."""
        self.pending.clear()


class GrowingSteps:
    """Steps whose groups arrive one by one (verl V1 writes each group into TransferQueue as it is ready, and
    trains the step once all are there): each arrival records its step again with every group so far; the
    rewind rule keeps the last record, and steps recorded after it are recorded again after it."""

    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder
        self.groups: dict[int, list[GroupRef]] = {}

    def add(self, step: int, refs: list[GroupRef]) -> None:
        """``refs`` joined step ``step``: its record (and those of later steps) written again, acknowledged."""
        self.groups.setdefault(step, []).extend(refs)
        for recorded in sorted(s for s in self.groups if s >= step):
            self.recorder.write(list(self.groups[recorded]), {}, recorded, recorded - 1)
        for done in [s for s in self.groups if s < step - 1]:  # the trainer is past them
            del self.groups[done]
