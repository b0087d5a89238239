"""The groups of one channel into verl's TransferQueue, from a thread: what verl's agent-loop workers do.

verl's V1 trainer registers each prompt in TransferQueue and samples the prompts whose status is
``finished`` or ``failure``. The feeder writes, for each prompt the manager handed to agents, its group
in verl's layout (``consumers.verl.transfer_queue``) as soon as the stream worker emits it, then tags the
prompt ``finished``. A prompt whose agents failed, or whose group the worker dropped (its filters, a
timeout), is tagged ``failure`` with the reason, as verl's agent loop tags a failed session: on the
training channel the worker decides (the agents' failure abandons the group on the ledger, and a group
complete before that is still emitted); on the validation channel, which keeps no ledger, at once.

It reads the groups topic from where it stood when the manager started: a group emitted earlier is one
dispatched before a resume, and is read where the ledger says it lies (``place``). On the training
channel each group written joins its prompt's step (``global_steps``) on the trained log
(``consumers.trained_log.GrowingSteps``) before the prompt is tagged ``finished``: verl cannot train the
step, let alone checkpoint it, before its batch is on record.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from trajbus.consumers.backends import TrainingBackend
from trajbus.consumers.batch_consumer import BatchConsumer
from trajbus.consumers.trained_log import GrowingSteps
from trajbus.consumers.verl.transfer_queue import group_records
from trajbus.infra.clients import reader
from trajbus.infra.topics import watermarks
from trajbus.pipelines.slime.harness import SAMPLE_INDEX, GroupRun
from trajbus.pipelines.verl.dispatches import Dispatches
from trajbus.streams.wire.ledger import DROPPED
from trajbus.streams.wire.prefix import StructuredGroup
from trajbus.streams.wire.trained import GroupRef

__all__ = ["GroupFeeder", "Expected"]

log = logging.getLogger("trajbus.verl")

POLL = 0.2
"""Seconds one read of the groups topic waits before the feeder looks at the agents and the ledger."""
MAX_WRITE = 32
"""Groups written into TransferQueue in one put (those already fetched): two round trips for all of them."""


class StructuredGroups(TrainingBackend):
    """The groups as read (the feeder lays them out per prompt): ``fetch_dataproto`` without tensors."""

    def convert(self, steps: list[Any], current_version: int | None = None) -> Any:
        raise NotImplementedError("the feeder reads groups, not steps")

    def convert_groups(self, groups: list[StructuredGroup], current_version: int | None = None) -> Any:
        return groups


@dataclass
class Expected:
    """A prompt handed to agents (or found on the topic): where its group goes in TransferQueue."""

    uid: str
    prompt: dict[str, Any]
    run: GroupRun | None = None
    given_up: str | None = None
    """Why its agents failed, once the group was given up."""


class GroupFeeder:
    """Ready groups of ``channel`` into TransferQueue partition ``partition_id`` (module docstring)."""

    def __init__(self, bootstrap_servers: str, prefix: str, channel: str, partition_id: str,
                 dispatches: Dispatches | None, tq: Any, steps: GrowingSteps | None = None) -> None:
        self.channel, self.partition_id, self.dispatches, self.tq = channel, partition_id, dispatches, tq
        self.steps = steps
        self.places: dict[str, GroupRef] = {}
        """prompt_uid -> where its group was read, until it joins its step on the trained log."""
        self.expected: dict[str, Expected] = {}
        self.written = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.consumer = BatchConsumer(channel, bootstrap_servers, prefix=prefix, backend=StructuredGroups(),
                                      keep=self.expected.__contains__, rank=0, world_size=1)
        self._probe = reader(bootstrap_servers, {"logger": log})
        self.consumer.load_state_dict({"topic": self.consumer.topic, "positions": self.end()})
        self.consumer.on_handed_out = self._read_at
        self._thread = threading.Thread(target=self._run, name=f"trajbus-verl-feeder-{channel}", daemon=True)

    def start(self) -> "GroupFeeder":
        self._thread.start()
        return self

    def _read_at(self, partition: int, offset: int, prompt_uid: str) -> None:
        self.places[prompt_uid] = GroupRef(partition, offset, prompt_uid)

    def end(self) -> dict[int, int]:
        """The groups topic's end offsets now."""
        return {p: watermarks(self._probe, tp, 30.0)[1] for p, tp in self._partitions()}

    def _partitions(self) -> list[tuple[int, Any]]:
        from confluent_kafka import TopicPartition

        return [(p, TopicPartition(self.consumer.topic, p)) for p in self.consumer.partitions or []]

    # -- the manager's side ----------------------------------------------------------------
    def tag(self, uids: list[str], status: str, reason: str | None = None) -> None:
        """Tag prompts (``running`` as verl's agent loop does before its sessions start; ``finished``;
        ``failure`` with the reason); the tags a prompt has already stay."""
        tag = {"status": status} if reason is None else {"status": status, "reason": reason}
        self.tq.kv_batch_put(keys=uids, partition_id=self.partition_id, tags=[dict(tag) for _ in uids])

    def expect(self, prompt_uid: str, uid: str, prompt: dict[str, Any]) -> Expected:
        """The group ``prompt_uid`` goes to verl's ``uid`` once emitted; set ``run`` once its agents start."""
        expected = Expected(uid, prompt)
        with self._lock:
            self.expected[prompt_uid] = expected
        return expected

    def place(self, prompt_uid: str, uid: str, prompt: dict[str, Any], placed: list[int]) -> bool:
        """Write the group the worker emitted at ``placed`` (a resume found it); False if it is gone."""
        partition, offset = placed
        positions = {**self.end(), partition: offset}
        with BatchConsumer(self.channel, self.consumer.bootstrap_servers, prefix=self.consumer.prefix,
                           backend=StructuredGroups(), keep=lambda found: found == prompt_uid, rank=0,
                           world_size=1) as lookup:
            lookup.load_state_dict({"topic": lookup.topic, "positions": positions})
            lookup.on_handed_out = self._read_at
            groups = lookup.fetch_dataproto(1, timeout=10.0)
        if not groups:
            log.warning("verl feeder: group %s not found at %s/%d (past retention?)", prompt_uid, partition, offset)
            return False
        self._write([(groups[0], Expected(uid, prompt))])
        return True

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        last_check = 0.0
        while not self._stop.is_set():
            try:
                self._write(self._fetched())
                if time.monotonic() - last_check > 0.5:
                    self._check_agents()
                    self._check_dropped()
                    last_check = time.monotonic()
            except Exception:  # noqa: BLE001 - the thread keeps feeding; verl waits on what is missing
                log.exception("verl feeder on channel %s", self.channel)
                self._stop.wait(1.0)

    def _fetched(self) -> list[tuple[StructuredGroup, Expected]]:
        """The groups emitted for expected prompts: the first within ``POLL``, then those already fetched."""
        fetched: list[tuple[StructuredGroup, Expected]] = []
        timeout = POLL
        while len(fetched) < MAX_WRITE:
            groups = self.consumer.fetch_dataproto(1, timeout=timeout)
            if not groups:
                return fetched
            with self._lock:
                expected = self.expected.pop(groups[0].prompt_uid, None)
            if expected is not None:
                fetched.append((groups[0], expected))
            timeout = 0.001
        return fetched

    def _write(self, fetched: list[tuple[StructuredGroup, Expected]]) -> None:
        """Every row of the groups in one put, then their prompts ``finished``; a put that fails tags them
        ``failure`` (verl would wait forever for a prompt left ``running``)."""
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        if not fetched:
            return
        uids = [expected.uid for _, expected in fetched]
        try:
            keys, fields, tags = [], [], []
            for group, expected in fetched:
                records = group_records(group, expected.uid, expected.prompt, SAMPLE_INDEX)
                keys += records.keys
                fields += records.fields
                tags += records.tags
            for layout in {tuple(f) for f in fields}:  # one put per field set (log-probs present or not)
                rows = [i for i, f in enumerate(fields) if tuple(f) == layout]
                self.tq.kv_batch_put(keys=[keys[i] for i in rows], partition_id=self.partition_id,
                                     fields=list_of_dict_to_tensordict([fields[i] for i in rows]),
                                     tags=[tags[i] for i in rows])
        except Exception as exc:  # noqa: BLE001 - the prompts fail, the feeder goes on
            log.exception("verl feeder: writing %d groups into TransferQueue failed", len(fetched))
            self.failed += len(uids)
            self.tag(uids, "failure", f"write into TransferQueue failed: {type(exc).__name__}: {exc}")
            return
        self._record_steps(fetched)
        self.written += len(uids)  # written already; counted before the tag, as a failure is
        self.tag(uids, "finished")

    def _record_steps(self, fetched: list[tuple[StructuredGroup, Expected]]) -> None:
        """Each group written joins its prompt's step on the trained log. A write Kafka refused past its timeout
        is logged as an error and the prompts are still finished: verl would wait for them forever."""
        if self.steps is None:
            return
        for group, expected in fetched:
            step, place = int(expected.prompt.get("global_steps", 0)), self.places.pop(group.prompt_uid)
            try:
                self.steps.add(step, [place])
            except Exception:  # noqa: BLE001 - the audit will miss the group; training must not stop
                log.exception("verl feeder: group %s of step %d is not on the trained log", group.prompt_uid, step)

    def _fail(self, prompt_uid: str, reason: str) -> None:
        with self._lock:
            expected = self.expected.pop(prompt_uid, None)
        if expected is None:
            return
        if expected.given_up:
            reason = f"{reason} ({expected.given_up})"
        log.warning("verl feeder: prompt %s (group %s) failed: %s", expected.uid, prompt_uid, reason)
        self.failed += 1  # counted before the tag: whoever sees the prompt failed sees it counted
        self.tag([expected.uid], "failure", reason)

    def _check_agents(self) -> None:
        """Agents that failed give their group up: on the ledger (the worker decides), else at once."""
        with self._lock:
            failed = [(uid, e, e.run.failure()) for uid, e in self.expected.items()
                      if e.run is not None and not e.given_up and e.run.done() and e.run.failure()]
        for prompt_uid, expected, why in failed:
            expected.given_up = f"agent failed: {why}"
            if self.dispatches is None:
                self._fail(prompt_uid, "given up")
            else:
                with self.dispatches.lock:
                    self.dispatches.ledger.abandon([prompt_uid], expected.given_up)

    def _check_dropped(self) -> None:
        """Groups the worker dropped (its filters, a timeout, an abandon) fail their prompt."""
        if self.dispatches is None:
            return
        with self.dispatches.lock:
            self.dispatches.ledger.refresh()
            outcomes = self.dispatches.ledger.view.outcomes
            dropped = [(uid, outcomes[uid].reason) for uid in list(self.expected)
                       if uid in outcomes and outcomes[uid].outcome == DROPPED]
        for prompt_uid, reason in dropped:
            self._fail(prompt_uid, f"dropped: {reason}")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.consumer.close()
        self._probe.close()
