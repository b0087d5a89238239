"""Emitting a ready group exactly once: filter, encode from the stored structure, send, record.

- a group is written to ``{prefix}.groups.{channel}`` and its acknowledgement is
  awaited *before* the table records it as emitted: the groups topic is never
  behind the table;
- each emitted group carries its source partition and offset in headers, and
  the table keeps a per-partition watermark of the groups-topic offsets it has
  recorded (``AssemblyState.advance_watermark``), which reconciliation reads past
  (``streams.worker.reconciliation``);
- the group record is built from the steps as stored (schema v2 deltas are kept as
  they are, ``prefix.regroup``): no prompt is rebuilt, so emitting costs the group's
  distinct tokens;
- a group record over ``max.message.bytes`` is written as chunks and named by a
  manifest (``streams.wire.chunks``); one over the channel's ``max_group_bytes``, or whose
  steps are gone or inconsistent, is dropped with its reason and assembly of every
  other group goes on;
- every outcome is written to the channel's prompt ledger (``streams.wire.ledger``), acknowledged,
  before the table records it (``streams.worker.settlement``), so a data source resuming from the
  ledger never misses one;
  a group its data source abandons is dropped here, in step order, unless already emitted.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

import numpy as np

from trajbus.streams.wire import chunks

from trajbus.streams.wire import codec

from trajbus.streams.client.dlq import DeadLetter
from trajbus.streams.wire import ledger
from trajbus.streams.wire.headers import GROUP_TRACEPARENTS, source_headers
from trajbus.streams.wire.prefix import PrefixError, StepDelta, regroup, resolve_group
from trajbus.streams.wire.records import ChunkedGroup, ReadyGroup, TrajectoryEnd
from trajbus.streams.wire.topics import steps_topic
from trajbus.streams.worker.assembly import PendingGroup
from trajbus.streams.worker.bodies import StepBodies
from trajbus.streams.worker.filters import judge
from trajbus.streams.worker.outbox import Placed, Sends
from trajbus.streams.worker.settings import WorkerSettings
from trajbus.streams.worker.settlement import Settlement
from trajbus.streams.worker.state_store import AssemblyState
from trajbus.streams.worker.stats import WorkerMetrics
from trajbus.streams.worker.traces import StepTraces

log = logging.getLogger("trajbus.worker")

TOO_LARGE = "too_large"
STEPS_EXPIRED = "steps_expired"
PREFIX_MISMATCH = "prefix_mismatch"
DROP_TIMEOUT = "timeout"


class Emission(Protocol):
    """What the assembler asks of emission: a group is ready, timed out, or abandoned by its data source."""

    async def finish(self, partition: int, group: PendingGroup, status: str) -> None: ...

    async def time_out(self, partition: int, group: PendingGroup) -> None: ...

    async def abandon(self, partition: int, channel: str, end: TrajectoryEnd, offset: int) -> None: ...


class GroupEmission:
    """Decides and writes each group's end: emitted (acknowledged) or dropped with its reason, then settled."""

    def __init__(self, settings: WorkerSettings, metrics: WorkerMetrics, state: AssemblyState, bodies: StepBodies,
                 sends: Sends, settlement: Settlement, filters: dict[str, Callable | None],
                 current_version: Callable[[str], int | None], traces: StepTraces | None = None) -> None:
        """``filters``: each channel's user group filter (None: none); ``current_version(channel)``: the
        policy version on the policy topic (None: none seen); ``traces``: the emit spans (tracing on)."""
        self.settings, self.metrics, self.state, self.bodies = settings, metrics, state, bodies
        self.sends, self.settlement, self.filters, self.current_version = sends, settlement, filters, current_version
        self.traces = traces

    async def finish(self, partition: int, group: PendingGroup, status: str) -> None:
        """Filter, emit (acknowledged), then record the outcome; the pending state goes."""
        channel = group.channel
        rules = self.settings.channel(channel)
        try:
            ready, shared, entries = await self.structured(partition, group, status)
        except (LookupError, PrefixError) as exc:
            reason = STEPS_EXPIRED if isinstance(exc, LookupError) else PREFIX_MISMATCH
            self.metrics.dropped.labels(channel, reason).inc()
            log.error("group dropped channel=%s prompt_uid=%s reason=%s: %s", channel, group.prompt_uid, reason, exc)
            await self.settle(partition, group, f"dropped ({reason})")
            return
        self.metrics.groups.labels(channel, "ready" if status == "complete" else status).inc()
        if self.filters[channel] is not None:  # the user's filter sees full prompts
            ready.steps = resolve_group(shared, entries)
        verdict = judge(ready, rules, self.current_version(channel), self.filters[channel])
        if verdict.staleness is not None:
            self.metrics.staleness.labels(channel).observe(verdict.staleness)
        if not verdict.keep:
            self.metrics.dropped.labels(channel, verdict.reason).inc()
            log.info("group dropped channel=%s prompt_uid=%s reason=%s", channel, group.prompt_uid, verdict.reason)
            await self.settle(partition, group, f"dropped ({verdict.reason})")
            return
        ready.ready_at = time.time()
        value = codec.preamble(codec.KIND_READY_GROUP) + codec.encode_group_body(ready, shared, entries)
        if len(value) > rules.max_group_bytes:
            await self.refuse_oversized(partition, group, ready, len(value))
            return
        manifest = None
        if not chunks.fits(value, self.settings.topics.max_message_bytes):
            manifest = await self.write_chunks(channel, ready.prompt_uid, value)
            value = codec.encode(manifest)
        groups_partition, offset = await self.emit(partition, group, ready, value, manifest)
        # Marker before watermark: both go to one changelog partition, in order, so
        # a recovered watermark always implies the markers of the groups below it.
        await self.settle(partition, group, "emitted", (groups_partition, offset))
        self.state.advance_watermark(partition, channel, groups_partition, offset)

    async def time_out(self, partition: int, group: PendingGroup) -> None:
        """Past its channel's ``group_timeout``: emitted as partial with ``min_rollouts`` complete, else dropped."""
        rules = self.settings.channel(group.channel)
        if len(group.complete_trajectories()) >= rules.min_rollouts:
            await self.finish(partition, group, "partial")
            return
        self.metrics.dropped.labels(group.channel, DROP_TIMEOUT).inc()
        log.info("group timed out channel=%s prompt_uid=%s complete=%d", group.channel, group.prompt_uid,
                 len(group.complete_trajectories()))
        await self.settle(partition, group, f"dropped ({DROP_TIMEOUT})")

    async def structured(self, partition: int, group: PendingGroup,
                         status: str) -> tuple[ReadyGroup, np.ndarray, list[StepDelta]]:
        """The group (its steps' prompts possibly partial) and its record's structure, built from the
        steps as stored: prompts are never rebuilt. A step whose base was left out of the group needs
        its trajectory's other steps too (rare: only then are they read)."""
        where = (group.channel, partition)
        ready, records = group.to_ready_group(await self.bodies.steps(where, group.chosen_offsets().values()),
                                              self.settings.channel(group.channel).n_rollouts, status=status)
        try:
            return ready, *regroup(records, [])
        except PrefixError:
            everything = await self.bodies.steps(where, group.offsets())
            return ready, *regroup(records, list(everything.values()))

    async def refuse_oversized(self, partition: int, group: PendingGroup, ready: ReadyGroup, size: int) -> None:
        """A group no record can carry: its reason (not its body) to the DLQ, the group dropped; assembly of
        every other group goes on (a send of it would fail, and stop the agent for all its partitions)."""
        channel = group.channel
        reason = (f"{TOO_LARGE}: group of {size} bytes ({len(ready.trajectory_uids)} trajectories, "
                  f"{len(ready.steps)} steps) exceeds max_group_bytes {self.settings.channel(channel).max_group_bytes}")
        await self.sends.dead_letter(channel, DeadLetter(ready.prompt_uid.encode(), None, reason,
                                                         steps_topic(channel, self.settings.topics.prefix),
                                                         partition, group.last_offset, codec.headers_for(ready)))
        self.metrics.dropped.labels(channel, TOO_LARGE).inc()
        log.warning("group dropped channel=%s prompt_uid=%s reason=%s", channel, group.prompt_uid, reason)
        await self.settle(partition, group, f"dropped ({TOO_LARGE})")

    async def write_chunks(self, channel: str, prompt_uid: str, value: bytes) -> ChunkedGroup:
        """Write a group's value as chunks, each acknowledged; returns the manifest that names them."""
        placed = await self.sends.chunks(channel, prompt_uid.encode(),
                                         chunks.split(value, self.settings.topics.max_message_bytes))
        return chunks.manifest(prompt_uid, self.sends.chunks_topic(channel), placed, value)

    async def emit(self, partition: int, group: PendingGroup, ready: ReadyGroup, value: bytes,
                   manifest: ChunkedGroup | None = None) -> tuple[int, int]:
        """Write the group (``value``: its record, or the ``manifest`` of its chunks) and wait for the
        broker's acknowledgement; returns (partition, offset)."""
        headers = codec.headers_for(manifest or ready) + source_headers(partition, group.last_offset)
        if self.traces is not None:  # each trajectory's emit span, for the trainer's fetch
            headers.append((GROUP_TRACEPARENTS, self.traces.start_emit(group.channel, ready.prompt_uid,
                                                                       ready.trajectory_uids)))
        placed = await self.sends.group(group.channel, ready.prompt_uid.encode(), value, headers,
                                        ready.ready_at)  # acknowledged before the table says "emitted"
        self.metrics.groups.labels(group.channel, "emitted").inc()
        log.info("group emitted channel=%s prompt_uid=%s status=%s trajectories=%d steps=%d offset=%d chunks=%d",
                 group.channel, ready.prompt_uid, ready.status, len(ready.trajectory_uids), len(ready.steps),
                 placed[1], len(manifest.offsets) if manifest else 0)
        return placed

    async def settle(self, partition: int, group: PendingGroup, outcome: str, placed: Placed | None = None) -> None:
        await self.settlement.settle(partition, group.channel, group.prompt_uid, group.last_offset, outcome, placed,
                                     group)
        if self.traces is not None:
            self.traces.end_emit(group.channel, group.prompt_uid, group.trajectories, outcome, placed)

    async def abandon(self, partition: int, channel: str, end: TrajectoryEnd, offset: int) -> None:
        """A data source gave the group up (``ledger.ABANDON``): dropped unless it already has an outcome,
        which then stands (the ledger holds it); steps of it that come later are late."""
        if self.state.marker(partition, channel, end.prompt_uid) is not None:
            self.metrics.duplicates.labels(channel).inc()
            return
        group = self.state.open_group(partition, channel, end.prompt_uid)
        group.last_offset = max(group.last_offset, offset)
        self.metrics.dropped.labels(channel, ledger.ABANDONED).inc()
        log.info("group abandoned channel=%s prompt_uid=%s why=%s trajectories=%d", channel, end.prompt_uid,
                 end.metadata[ledger.ABANDON], len(group.trajectories))
        await self.settle(partition, group, f"dropped ({ledger.ABANDONED})")
