"""The directory of an export's Parquet parts: each written whole or not at all, each naming what it covers.

A part is written to a hidden temporary file, flushed to disk and renamed into place
(``os.replace``), so a reader (``datasets.load_dataset("parquet", data_files=DIR/"*.parquet")``)
never sees half a part. Its Parquet key-value metadata (``trajbus.export``, JSON) names the topic,
the shape and, per partition, the offset after the last group record the parts up to it cover:
the directory itself is where an export resumes, so a group is written exactly once across a
``kill -9`` and a restart (the consumer group's commits are only there to show the lag).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["ExportState", "PartStore", "PartWriter", "METADATA_KEY"]

METADATA_KEY = b"trajbus.export"
PART_GLOB = "part-*.parquet"
TEMPORARY_PREFIX = ".writing-"
COMPRESSION, COMPRESSION_LEVEL = "zstd", 1
"""zstd at level 1: a quarter fewer bytes than snappy for token ids (their high bits are zeros), near its speed."""


class PartsMismatch(ValueError):
    """The directory holds parts of another export (topic or shape); the text names both."""


@dataclass
class ExportState:
    """What the parts on disk cover: where each partition resumes, and the counts so far."""

    offsets: dict[int, int] = field(default_factory=dict)
    newest_version: int | None = None
    parts: int = 0
    rows: int = 0
    groups: int = 0

    def as_json(self, topic: str, shape: str) -> bytes:
        return json.dumps({"topic": topic, "shape": shape, "offsets": {str(p): o for p, o in self.offsets.items()},
                           "newest_version": self.newest_version, "parts": self.parts, "rows": self.rows,
                           "groups": self.groups}).encode()


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class PartStore:
    """The parts of one export of ``topic`` in ``shape`` under ``directory``."""

    def __init__(self, directory: Path, topic: str, shape: str) -> None:
        self.directory, self.topic, self.shape = Path(directory), topic, shape

    def parts(self) -> list[Path]:
        return sorted(self.directory.glob(PART_GLOB))

    def resume(self) -> ExportState:
        """The state the parts on disk cover (a fresh one for none); leftovers of an interrupted write are removed.
        Raises ``PartsMismatch`` for parts of another export."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(f"{TEMPORARY_PREFIX}*"):
            leftover.unlink(missing_ok=True)
        state = ExportState()
        for path in self.parts():
            found = self.read_metadata(path)
            if (found["topic"], found["shape"]) != (self.topic, self.shape):
                raise PartsMismatch(f"{self.directory} holds an export of {found['topic']} in the "
                                    f"{found['shape']} shape, not of {self.topic} in the {self.shape} shape; "
                                    f"choose another --output")
            for partition, offset in found["offsets"].items():
                state.offsets[int(partition)] = max(offset, state.offsets.get(int(partition), 0))
            if found["newest_version"] is not None:
                state.newest_version = max(found["newest_version"], state.newest_version or found["newest_version"])
            state.parts, state.rows, state.groups = state.parts + 1, max(state.rows, found["rows"]), \
                max(state.groups, found["groups"])
        return state

    @staticmethod
    def read_metadata(path: Path) -> dict:
        """A part's ``trajbus.export`` metadata."""
        metadata = pq.read_schema(path).metadata or {}
        if METADATA_KEY not in metadata:
            raise PartsMismatch(f"{path} is no trajbus export part (no {METADATA_KEY.decode()} metadata)")
        return json.loads(metadata[METADATA_KEY])

    def write(self, table: pa.Table, state: ExportState) -> Path:
        """``table`` as the next part, covering ``state`` (its ``parts`` counts this one); atomic."""
        name = f"part-{state.parts - 1:06d}.parquet"
        final = self.directory / name
        temporary = self.directory / f"{TEMPORARY_PREFIX}{name}.tmp"  # no glob of parts sees it
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               METADATA_KEY: state.as_json(self.topic, self.shape)})
        with open(temporary, "wb") as sink:
            encode_part(table, sink)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(temporary, final)
        _fsync_directory(self.directory)
        return final


def encode_part(table: pa.Table, sink: Any) -> None:
    """``table`` as Parquet into ``sink``: zstd level 1, a dictionary only for the columns that repeat (token
    ids are near-unique: a dictionary attempt on them tripled the time)."""
    pq.write_table(table, sink, compression=COMPRESSION, compression_level=COMPRESSION_LEVEL,
                   use_dictionary=["prompt_uid", "channel", "group_status", "topic"])


class PartWriter:
    """Writes a store's parts one after another on a thread of its own, so the next part is read and decoded
    while one is compressed and written (Arrow and zstd release the GIL). Parts land in the order given;
    after a failed write none follows, so no part ever covers the groups of one that is missing."""

    def __init__(self, store: PartStore) -> None:
        self.store = store
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-parts")
        self._pending: list[tuple[Future, ExportState]] = []
        self._failed = threading.Event()

    def submit(self, table: pa.Table, state: ExportState) -> None:
        """Queue ``table`` as the part that covers ``state`` (copied: the caller goes on counting)."""
        covered = dataclasses.replace(state, offsets=dict(state.offsets))
        self._pending.append((self._thread.submit(self._write, table, covered), covered))

    def _write(self, table: pa.Table, state: ExportState) -> Path:
        if self._failed.is_set():
            raise RuntimeError("an earlier part failed to be written; this one would cover its groups")
        try:
            return self.store.write(table, state)
        except BaseException:
            self._failed.set()
            raise

    def written(self, wait: bool = False) -> list[tuple[Path, ExportState]]:
        """The parts written since the last call, in order (``wait``: all queued); a failed write raises."""
        done = []
        while self._pending and (wait or self._pending[0][0].done()):
            future, state = self._pending.pop(0)
            done.append((future.result(), state))
        return done

    def close(self) -> None:
        """Stop taking parts; one being written is finished (whole), those queued behind it are dropped."""
        self._thread.shutdown(wait=True, cancel_futures=True)
