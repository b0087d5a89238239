"""A data source's handle on its channel's prompt ledger (``streams.wire.ledger``) on Kafka.

``PromptLedger`` reads the ledger to its end and folds it (``view``), writes dispatches
and buffer entries acknowledged, and abandons what a crashed run left open: it sends the
abandon events and waits until the worker has settled every one of them, so the caller
knows, per prompt, whether its group is on the groups topic or must be dispatched again.
A record that cannot be decoded goes to the DLQ and reading goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from confluent_kafka import KafkaError, Producer, TopicPartition
from prometheus_client import Counter, Gauge

from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.clients import acked_producer, reader
from trajbus.infra.topics import watermarks
from trajbus.streams.client.delivery import produce_acked
from trajbus.streams.client.dlq import dead_letter
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.headers import content_type_headers
from trajbus.streams.wire.ledger import (ABANDON, ABANDON_TRAJECTORY, CONTENT_TYPE, Dispatch, LedgerError, LedgerView,
                                         Record, decode_record, encode_record)
from trajbus.streams.wire.topics import DEFAULT_PREFIX, prompts_topic, validate_channel

log = logging.getLogger("trajbus.ledger")

DISPATCHED = Counter("trajbus_ledger_dispatched", "Prompt groups a data source recorded as handed out",
                     ["channel", "source"])
REISSUED = Counter("trajbus_ledger_reissued", "Prompt groups dispatched again after a resume (their first "
                   "dispatch was abandoned)", ["channel"])
OPEN = Gauge("trajbus_ledger_open_prompts", "Prompt groups dispatched and not yet settled by the worker",
             ["channel"])
DEPTH = Gauge("trajbus_ledger_depth", "Prompt groups dispatched and not yet trained (as of the trainer's "
              "position)", ["channel"])


class PromptLedger:
    """The ledger of one channel: ``refresh`` reads on, ``write`` appends acknowledged."""

    def __init__(self, bootstrap_servers: str | None = None, channel: str = "train", prefix: str = DEFAULT_PREFIX,
                 policy_version: Callable[[], int | None] | None = None, timeout: float = 30.0) -> None:
        self.channel = validate_channel(channel)
        self.prefix = prefix
        self.topic = prompts_topic(channel, prefix)
        self.bootstrap_servers = resolve_bootstrap_servers(bootstrap_servers)
        self.policy_version = policy_version or (lambda: None)
        """The version a dispatch is stamped with (the trainer's policy when the group is handed out)."""
        self.timeout = timeout
        self.view = LedgerView()
        self.position = 0
        """The offset after the last record folded into ``view``."""
        self._producer: Producer | None = None
        self._steps: StepProducer | None = None
        self._reader = reader(self.bootstrap_servers, {"group.id": f"{prefix}.ledger-reader",
                                                       "enable.partition.eof": True, "logger": log})

    def provision(self) -> None:
        """Create the channel's topics (the ledger among them) if they are missing."""
        self._step_producer().provision(self.channel)

    def end(self) -> int:
        """The ledger's end offset now."""
        return watermarks(self._reader, TopicPartition(self.topic, 0), self.timeout)[1]

    def refresh(self) -> int:
        """Fold every record up to the ledger's end now; returns how many were read."""
        end = self.end()
        if end <= self.position:
            return 0
        self._reader.assign([TopicPartition(self.topic, 0, self.position)])
        read, deadline = 0, time.monotonic() + self.timeout
        while self.position < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.topic}: read to {self.position} of {end} in {self.timeout:g}s")
            message = self._reader.poll(0.5)
            if message is None:
                continue
            if message.error():
                if message.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("ledger read error on %s: %s", self.topic, message.error().str())
                continue
            self.position = message.offset() + 1
            read += 1
            try:
                self.view.apply(decode_record(message.key(), message.value()))
            except LedgerError as exc:
                dead_letter(self._acked(), self.prefix, message, f"undecodable: {exc}", log, self.timeout)
        OPEN.labels(self.channel).set(len(self.view.open()))
        return read

    def write(self, records: list[Record]) -> None:
        """Append ``records`` in order and wait for the broker's acknowledgement of every one."""
        headers = content_type_headers(CONTENT_TYPE)
        produce_acked(self._acked(), self.topic, [(*encode_record(record), headers) for record in records],
                      self.timeout)
        for record in records:
            self.view.apply(record)
            if isinstance(record, Dispatch):
                DISPATCHED.labels(self.channel, record.source).inc()
                if record.source == "reissue":
                    REISSUED.labels(self.channel).inc()

    def settle_open(self, why: str, timeout: float = 120.0) -> list[Dispatch]:
        """Abandon every dispatch left open (by a run that crashed) and wait until the worker has settled
        each: emitted (its group is on the groups topic) or dropped. Returns the dispatches to issue again."""
        self.refresh()
        left_open = self.view.open()
        if left_open:
            self.abandon([dispatch.prompt_uid for dispatch in left_open], why)
            deadline = time.monotonic() + timeout
            while self.view.open():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.topic}: {len(self.view.open())} abandoned prompts not settled "
                                       f"within {timeout:g}s (is a stream worker running for {self.channel!r}?)")
                time.sleep(0.1)
                self.refresh()
        return self.view.due_again()

    def abandon(self, prompt_uids: list[str], why: str) -> None:
        """Tell the worker these groups are given up (acknowledged): dropped as ``abandoned`` unless emitted."""
        producer = self._step_producer()
        for prompt_uid in prompt_uids:
            producer.complete_trajectory(ABANDON_TRAJECTORY, prompt_uid, channel=self.channel,
                                         metadata={ABANDON: why})
        log.info("ledger abandoned channel=%s prompts=%d why=%s", self.channel, len(prompt_uids), why)

    def _acked(self) -> Producer:
        if self._producer is None:
            self._producer = acked_producer(self.bootstrap_servers, {"logger": log})
        return self._producer

    def _step_producer(self) -> StepProducer:
        if self._steps is None:
            self._steps = StepProducer(self.bootstrap_servers, settings=TopicSettings(prefix=self.prefix))
        return self._steps

    def close(self) -> None:
        self._reader.close()
        if self._steps is not None:
            self._steps.close()
        if self._producer is not None:
            self._producer.flush(self.timeout)
            self._producer = None

    def __enter__(self) -> "PromptLedger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
