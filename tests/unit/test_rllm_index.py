"""The rLLM trace store's index (consumers.rllm.index): the rules of rLLM's reads over the folded log."""

from __future__ import annotations

from trajbus.consumers.rllm.index import TraceIndex
from trajbus.consumers.rllm.traces import TraceEntry, entry_of, trace_step


def entry(trace_id: str, session_id: str, at: float, step_index: int = 0, incarnation: str | None = None,
          **data) -> TraceEntry:
    trace = {"prompt_token_ids": [1, 2], "completion_token_ids": [3], "n": trace_id, **data}
    return entry_of(trace_step(trace_id, session_id, trace, incarnation or f"{session_id}@1", step_index, at))


def index_of(*entries: TraceEntry) -> TraceIndex:
    index = TraceIndex()
    for item in entries:
        assert index.add(item)
    return index


def test_a_session_reads_in_store_time_order_whatever_the_read_order():
    index = index_of(entry("b", "s", 20.0, 1), entry("c", "s", 30.0, 2), entry("a", "s", 10.0, 0),
                     entry("x", "other", 15.0))
    assert [e.trace_id for e in index.session_traces("s")] == ["a", "b", "c"]
    assert [e.trace_id for e in index.session_traces("s", since=20.0)] == ["b", "c"]  # at or after
    assert [e.trace_id for e in index.session_traces("s", since=11.0, limit=1)] == ["b"]
    assert [e.trace_id for e in index.session_traces("s", limit=0)] == []
    assert index.session_traces("nobody") == []


def test_the_first_copy_of_a_trace_stands():
    index = index_of(entry("a", "s", 10.0, n="first"))
    assert not index.add(entry("a", "s", 11.0, 1, n="second"))
    assert index.get("a").data()["n"] == "first" and index.size() == (1, 1)


def test_sessions_are_listed_newest_first_counting_the_traces_since():
    index = index_of(entry("a1", "a", 10.0), entry("a2", "a", 40.0, 1), entry("b1", "b", 20.0), entry("c1", "c", 5.0))
    assert index.sessions() == [
        {"session_id": "b", "trace_count": 1, "first_trace_at": 20.0, "last_trace_at": 20.0},
        {"session_id": "a", "trace_count": 2, "first_trace_at": 10.0, "last_trace_at": 40.0},
        {"session_id": "c", "trace_count": 1, "first_trace_at": 5.0, "last_trace_at": 5.0}]
    assert [(s["session_id"], s["trace_count"]) for s in index.sessions(since=15.0)] == [("a", 1), ("b", 1)]
    assert [s["session_id"] for s in index.sessions(limit=2)] == ["b", "a"]


def test_a_tombstone_removes_its_incarnation_and_what_comes_after_it():
    index = index_of(entry("a", "s", 10.0, 0, "s@1"), entry("b", "s", 11.0, 1, "s@1"), entry("x", "t", 12.0))
    assert index.delete("s", "s@1") == 2
    assert index.get("a") is None and index.session_traces("s") == [] and index.size() == (1, 1)
    assert [s["session_id"] for s in index.sessions()] == ["t"]
    assert not index.add(entry("late", "s", 13.0, 2, "s@1"))  # written while the delete went out: gone too
    assert index.add(entry("new", "s", 14.0, 0, "s@2"))  # the session's next incarnation counts
    assert [e.trace_id for e in index.session_traces("s")] == ["new"]
    assert index.delete("s", "s@9") == 0


def test_the_open_incarnation_is_the_newest_unless_it_was_ended():
    index = index_of(entry("a", "s", 10.0, 0, "s@1"), entry("b", "s", 11.0, 1, "s@1"))
    assert index.open_incarnation("s") == "s@1" and index.last("s@1").trace_id == "b"
    assert index.steps("s@1") == [0, 1] and index.incarnations("s") == ["s@1"]
    index.end("s@1")
    assert index.open_incarnation("s") is None
    index.add(entry("c", "s", 12.0, 0, "s@2"))
    assert index.open_incarnation("s") == "s@2" and index.incarnations("s") == ["s@1", "s@2"]
    assert index.open_incarnation("nobody") is None
