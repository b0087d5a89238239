"""``trajbus export``'s engine: a channel's groups, or a window of them, into a dataset on disk.

The window is ``Replay``'s (``consumers.replay``: by offsets or wall-clock times); the group
records are read from it with the wire's own decoding (``codec.decode`` and, for a group cut
into chunks, ``ChunkReader``), kept in their prefix structure so that a row costs its distinct
tokens (``export_rows``). Rows gather into Parquet parts (``export_parts``), each written
atomically with the offsets it covers: a run, killed or not, resumes where the parts on disk
end, so each group is written once. ``follow`` keeps reading as groups arrive; after each part
the export's consumer group commits the offsets it covers, so ``trajbus topics`` shows its lag.
``--format hf`` gathers the parts beside the output and saves them as one ``datasets`` dataset
(``save_to_disk``) once the window is read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import KafkaException, TopicPartition

from trajbus.consumers.fetch_traces import group_parents
from trajbus.consumers.group_records import decode_group
from trajbus.consumers.replay import Replay, ReplayError
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.clients import reader
from trajbus.infra.terminal import ProgressLine
from trajbus.infra.topics import read_partition, watermarks
from trajbus.pipelines.export_filters import TrajectoryFilter
from trajbus.pipelines.export_parts import ExportState, PartStore, PartWriter
from trajbus.pipelines.export_rows import RL_SCHEMA, Provenance, RlColumns, trajectories
from trajbus.pipelines.export_sft import SFT_SCHEMA, SftRows
from trajbus.streams.client.chunks import ChunkReader
from trajbus.streams.wire.prefix import PrefixError, StructuredGroup
from trajbus.streams.wire.topics import DEFAULT_PREFIX, groups_topic

__all__ = ["ExportError", "ExportSettings", "ExportSummary", "Exporter", "FORMATS", "SHAPES", "export_group_id"]

log = logging.getLogger(__name__)

SHAPES = ("rl", "sft")
FORMATS = ("parquet", "hf")


class ExportError(ValueError):
    """An export that cannot run as asked (a window, a directory); the text names the problem."""


def export_group_id(prefix: str, channel: str, output: Path) -> str:
    """The default consumer group of an export: one per channel and output directory, the same at each restart."""
    return f"{prefix}.export.{channel}.{hashlib.sha1(str(Path(output).resolve()).encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class ExportSettings:
    channel: str
    output: Path
    bootstrap_servers: str | None = None
    prefix: str = DEFAULT_PREFIX
    shape: str = "rl"
    format: str = "parquet"
    keep: TrajectoryFilter = field(default_factory=TrajectoryFilter)
    start_time: float | None = None
    end_time: float | None = None
    start_offset: int | None = None
    end_offset: int | None = None
    follow: bool = False
    part_rows: int = 4096
    part_bytes: int = 32 * 2**20
    """A part is written once it holds this many rows or token bytes (or the data read so far ends): parts of
    tens of MB, one written while the next is read."""
    poll_interval: float = 0.5
    group_id: str | None = None
    tokenizer: Any = None

    @property
    def parts_directory(self) -> Path:
        """Where the parts go: the output itself, or beside it (hidden) until a ``hf`` dataset is saved."""
        return self.output if self.format == "parquet" else self.output.parent / f".{self.output.name}.parts"


@dataclass
class ExportSummary:
    state: ExportState
    """What the parts on disk now cover."""
    parts_written: int = 0
    rows_written: int = 0
    groups_read: int = 0
    directory: Path | None = None


class Exporter:
    """One export run; ``stop`` ends a ``follow`` run between reads (what was written stays)."""

    def __init__(self, settings: ExportSettings, progress: ProgressLine | None = None,
                 stop: threading.Event | None = None) -> None:
        if settings.shape not in SHAPES or settings.format not in FORMATS:
            raise ExportError(f"shape {settings.shape!r} / format {settings.format!r}: expected {SHAPES} / {FORMATS}")
        self.settings = settings
        self.servers = resolve_bootstrap_servers(settings.bootstrap_servers)
        self.topic = groups_topic(settings.channel, settings.prefix)
        self.progress = progress
        self.stop = stop or threading.Event()
        self.store = PartStore(settings.parts_directory, self.topic, settings.shape)
        self.state = ExportState()
        self.summary = ExportSummary(self.state)
        self.rows = self._new_rows()
        self.pending_groups = 0
        self.consumed: dict[int, int] = {}
        self._consumer: Any = None
        self._chunks = ChunkReader(self.servers)

    def _new_rows(self) -> RlColumns | SftRows:
        return RlColumns() if self.settings.shape == "rl" else SftRows(self.settings.tokenizer)

    def _window(self) -> dict[int, tuple[int, int]]:
        s = self.settings
        try:
            with Replay(s.channel, self.servers, prefix=s.prefix, start_time=s.start_time, end_time=s.end_time,
                        start_offset=s.start_offset, end_offset=s.end_offset) as replay:
                return dict(replay.ranges)
        except ReplayError as exc:
            raise ExportError(str(exc)) from None

    def run(self) -> ExportSummary:
        """Export the window (``follow``: and what arrives after it, until ``stop``); the summary of the run."""
        s = self.settings
        if s.format == "hf" and s.output.exists() and any(s.output.iterdir()):
            raise ExportError(f"--output {s.output}: exists and is not empty; a dataset is saved to a new folder")
        window = self._window()
        self.state = self.summary.state = self.store.resume()
        self._rows_before = self.state.rows
        self.summary.directory = self.store.directory
        self.consumed = {p: max(start, self.state.offsets.get(p, start)) for p, (start, _end) in window.items()}
        self._consumer = reader(self.servers, {"group.id": s.group_id or export_group_id(s.prefix, s.channel, s.output),
                                               "enable.partition.eof": True, "fetch.wait.max.ms": 50, "logger": log})
        self._writer = PartWriter(self.store)
        try:
            if s.follow:
                self._follow()
            else:
                self._read({p: (self.consumed[p], end) for p, (_start, end) in window.items()})
                self._flush()
                self._written(wait=True)
        finally:
            self._writer.close()
            self._consumer.close()
            self._chunks.close()
        if s.format == "hf":
            save_dataset(self.store.parts(), s.output, RL_SCHEMA if s.shape == "rl" else SFT_SCHEMA)
            shutil.rmtree(self.store.directory, ignore_errors=True)
            self.summary.directory = s.output
        return self.summary

    def _follow(self) -> None:
        """Read to the end of every partition, write what was read, wait for more; until ``stop``."""
        while not self.stop.is_set():
            ranges = {}
            for partition, start in self.consumed.items():
                low, high = watermarks(self._consumer, TopicPartition(self.topic, partition), 10.0)
                if start < low:
                    log.warning("export gap topic=%s partition=%d from=%d to=%d why=retention deleted them",
                                self.topic, partition, start, low)
                ranges[partition] = (max(start, low), high)
            if any(end > start for start, end in ranges.values()):
                self._read(ranges)
                self._flush()
                self._written(wait=True)  # caught up: what was read is on disk before waiting for more
            else:
                self._show("following, up to date", final=True)
                self.stop.wait(self.settings.poll_interval)

    def _read(self, ranges: dict[int, tuple[int, int]]) -> None:
        for partition, (start, end) in ranges.items():
            for message in read_partition(self._consumer, self.topic, partition, start, end):
                self._take(partition, message)
                self.consumed[partition] = message.offset() + 1
                if len(self.rows) >= self.settings.part_rows or self.rows.nbytes >= self.settings.part_bytes:
                    self._flush()
            self.consumed[partition] = max(self.consumed[partition], end)

    def _group(self, partition: int, message: Any) -> StructuredGroup | None:
        """The group a record holds, in its prefix structure; None (logged) for a record that holds none."""
        try:
            return decode_group(self._chunks, message.value())
        except ValueError as exc:  # undecodable, or a record that is no group
            log.warning("export skips %s[%d]@%d: %s", self.topic, partition, message.offset(), exc)
            return None

    def _take(self, partition: int, message: Any) -> None:
        """A group record's kept trajectories, into the rows of the next part."""
        group = self._group(partition, message)
        if group is None:
            return
        try:
            found = trajectories(group)
        except PrefixError as exc:
            log.warning("export skips %s[%d]@%d: %s", self.topic, partition, message.offset(), exc)
            return
        newest = max((v for t in found for v in t.versions), default=None)
        if newest is not None:
            self.state.newest_version = max(newest, self.state.newest_version if self.state.newest_version
                                            is not None else newest)
        where = Provenance(self.topic, partition, message.offset(), group_parents(message.headers()))
        for trajectory in found:
            if trajectory.steps and self.settings.keep.keeps(trajectory, self.state.newest_version):
                self.rows.add(trajectory, group, where)
        self.pending_groups += 1
        self.summary.groups_read += 1
        self._show()

    def _flush(self) -> None:
        """The rows gathered as the next part, covering every record read so far (written on the part
        writer's thread); then the parts written so far are committed, for the lag."""
        if len(self.rows):
            state, count = self.state, len(self.rows)
            state.offsets, state.parts = dict(self.consumed), state.parts + 1
            state.rows, state.groups = state.rows + count, state.groups + self.pending_groups
            self._writer.submit(self.rows.table(), state)
            self.rows, self.pending_groups = self._new_rows(), 0
        self._written(wait=False)

    def _written(self, wait: bool) -> None:
        """Count, log and commit the parts on disk (``wait``: once every queued part is)."""
        done = self._writer.written(wait)
        for path, state in done:
            count, self._rows_before = state.rows - self._rows_before, state.rows
            self.summary.parts_written += 1
            self.summary.rows_written += count
            log.info("export part=%s rows=%d topic=%s offsets=%s", path.name, count, self.topic, state.offsets)
        if not done:
            return
        self._show(final=True)
        try:
            self._consumer.commit(offsets=[TopicPartition(self.topic, p, o) for p, o in done[-1][1].offsets.items()],
                                  asynchronous=False)
        except KafkaException as exc:  # the lag shown lags; what is exported does not depend on it
            log.warning("export commit failed (only the lag shown is behind): %s", exc)

    def _show(self, note: str = "", final: bool = False) -> None:
        if self.progress is not None:
            self.progress.update(f"export {self.topic}: {self.summary.groups_read} groups read, "
                                 f"{self.state.rows + len(self.rows)} rows, {self.state.parts} parts"
                                 + (f"; {note}" if note else ""), final=final)


def save_dataset(parts: list[Path], output: Path, schema: pa.Schema) -> None:
    """The parts as one ``datasets`` dataset (``save_to_disk``), put in place whole: saved beside, then renamed."""
    import datasets
    from datasets.table import InMemoryTable

    table = pa.concat_tables([pq.read_table(part) for part in parts]) if parts else schema.empty_table()
    saving = output.parent / f".{output.name}.saving"
    shutil.rmtree(saving, ignore_errors=True)
    datasets.Dataset(InMemoryTable(table.replace_schema_metadata(None))).save_to_disk(str(saving))
    if output.exists():
        output.rmdir()  # empty (checked before the export began)
    os.replace(saving, output)
