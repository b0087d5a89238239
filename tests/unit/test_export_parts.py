"""An export's part directory: parts appear whole, name what they cover, and are where a run resumes."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajbus.pipelines.export_parts import ExportState, PartsMismatch, PartStore


def table(n: int) -> pa.Table:
    return pa.table({"offset": pa.array(range(n), pa.int64())})


def test_parts_resume_from_what_they_cover_and_leftovers_go(tmp_path):
    store = PartStore(tmp_path, "p.groups.train", "rl")
    assert store.resume() == ExportState()
    store.write(table(2), ExportState(offsets={0: 5, 1: 2}, newest_version=3, parts=1, rows=2, groups=2))
    store.write(table(3), ExportState(offsets={0: 9, 1: 2}, newest_version=4, parts=2, rows=5, groups=4))
    (tmp_path / ".writing-part-000002.parquet.tmp").write_bytes(b"half a part")  # a kill -9 mid-write
    resumed = PartStore(tmp_path, "p.groups.train", "rl").resume()
    assert resumed == ExportState(offsets={0: 9, 1: 2}, newest_version=4, parts=2, rows=5, groups=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-000000.parquet", "part-000001.parquet"]
    assert pq.read_table(tmp_path / "part-000001.parquet").column("offset").to_pylist() == [0, 1, 2]
    assert PartStore.read_metadata(tmp_path / "part-000000.parquet")["offsets"] == {"0": 5, "1": 2}


def test_parts_of_another_export_are_refused(tmp_path):
    PartStore(tmp_path, "p.groups.train", "rl").write(table(1), ExportState(offsets={0: 1}, parts=1, rows=1))
    with pytest.raises(PartsMismatch, match="choose another --output"):
        PartStore(tmp_path, "p.groups.train", "sft").resume()
