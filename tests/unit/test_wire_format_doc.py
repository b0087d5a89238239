"""docs/wire-format.md is precise enough to decode a record: its standard-library decoder must agree."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import pytest
from pytest_codeblocks import extract_from_file

from trajbus.streams.wire import codec, dlq, headers
from trajbus.streams.wire.chunks import RECORD_OVERHEAD, manifest, split
from trajbus.streams.wire.prefix import PrefixEncoder, structure
from trajbus.streams.wire.records import ReadyGroup, Step, TrajectoryEnd
from tests.unit.test_prefix import trajectory

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-format.md"
WIRE = Path(__file__).resolve().parents[2] / "streams" / "wire"


def doc_blocks() -> list[str]:
    """The doc's Python blocks as written (read by pytest-codeblocks, as the README's are)."""
    return [block.code for block in extract_from_file(DOC) if block.syntax == "python"]


def documented_decoder() -> dict:
    block = doc_blocks()[0]
    definitions = block.split("value = ...")[0]
    namespace: dict = {}
    exec(definitions, namespace)  # the doc's own code, with no trajbus import
    return namespace


def documented_subscriber() -> dict:
    namespace = documented_decoder()
    exec(doc_blocks()[1], namespace)  # the worked example's functions (its main guarded by __name__)
    return namespace


def test_documented_step_decoder_reads_what_the_codec_writes():
    step_body = documented_decoder()["step_body"]
    for top in (200, 60000, 150000):
        step = Step(prompt_ids=[top, 1, 2], response_ids=[3, top], trajectory_uid="tr-é", prompt_uid="p",
                    step_index=4, reward=-1.25, policy_version=3, is_last=True, metadata={"k": "v"},
                    rollout_log_probs=[-0.5, -2.0], channel="train", n_rollouts=4)
        value = codec.encode(step)
        assert value[:2] == b"TB" and value[2] == 2 and value[3] == 1
        decoded, end = step_body(value, 4)
        assert end == len(value)
        assert decoded == dict(trajectory_uid="tr-é", prompt_uid="p", step_index=4, reward=-1.25, is_last=True,
                               prompt_ids=[top, 1, 2], response_ids=[3, top], rollout_log_probs=[-0.5, -2.0],
                               metadata={"k": "v"}, prompt_form=0, prefix_len=0, base_index=0, keyframe_at=0.0,
                               version_segments=None)
    cut = Step(prompt_ids=[1], response_ids=[2, 3, 4], trajectory_uid="t", prompt_uid="p", policy_version=-2,
               version_segments=[[0, -2], [2, 2**40]])
    decoded, end = step_body(codec.encode(cut), 4)
    assert end == len(codec.encode(cut)) and decoded["version_segments"] == [[0, -2], [2, 2**40]]


def test_documented_decoder_resolves_a_multi_turn_trajectory_as_the_producer_writes_it():
    ns = documented_decoder()
    encoder, contexts = PrefixEncoder(), {}
    steps = trajectory("t", 5)
    for step in steps:
        value = codec.encode(encoder.delta(step))
        decoded, _ = ns["step_body"](value, 4, value[2])
        resolved = ns["resolve"](decoded, contexts)
        assert (resolved["prompt_ids"], resolved["response_ids"]) == (step.prompt_ids, step.response_ids)
    assert ns["step_body"](codec.encode(encoder.delta(trajectory("u", 2)[1])), 4)[0]["prompt_form"] == 0
    encoder = PrefixEncoder()  # a reader that never saw step 0 of "t2" cannot resolve step 1
    encoder.delta(trajectory("t2", 2)[0])
    orphan, _ = ns["step_body"](codec.encode(encoder.delta(trajectory("t2", 2)[1])), 4)
    with pytest.raises(KeyError):
        ns["resolve"](orphan, {})


def test_documented_decoder_reads_the_steps_inside_a_ready_group():
    ns = documented_decoder()
    steps = [s for uid in ("t0", "t1", "t2") for s in trajectory(uid, 3)]
    value = codec.encode(ReadyGroup("p", "train", steps, 3, ready_at=1.0))
    pos = 4
    prompt_uid, pos = ns["string"](value, pos)
    channel, pos = ns["string"](value, pos)
    pos += 12  # n_rollouts u32 + ready_at f64
    status, pos = ns["string"](value, pos)
    _meta, pos = ns["string"](value, pos)
    shared, pos = ns["ids"](value, pos)
    count, pos = ns["uvarint"](value, pos)
    decoded, contexts = [], {}
    for _ in range(count):
        length, pos = ns["uvarint"](value, pos)
        step, end = ns["step_body"](value[pos:pos + length])
        assert end == length
        decoded.append(ns["resolve"](step, contexts, shared))
        pos += length
    assert (prompt_uid, channel, status, pos) == ("p", "train", "complete", len(value))
    assert [(s["trajectory_uid"], s["prompt_ids"], s["response_ids"]) for s in decoded] == \
        [(s.trajectory_uid, s.prompt_ids, s.response_ids) for s in steps]


def test_documented_subscriber_joins_the_chunks_a_chunked_group_names():
    ns = documented_decoder()
    exec(doc_blocks()[1], ns)  # the worked example's functions
    value = codec.encode(ReadyGroup("p", "train", trajectory("t0", 3), 1, ready_at=1.0))
    chunks = [bytes(c) for c in split(value, RECORD_OVERHEAD + 50)]
    offsets = [3 + 2 * i for i in range(len(chunks))]
    record = codec.encode(manifest("p", "x.chunks.train", [(1, offset) for offset in offsets], value))
    decoded, end = ns["chunked_body"](record, 4)
    assert end == len(record)
    assert decoded == dict(kind="chunked_group", prompt_uid="p", topic="x.chunks.train", partition=1,
                           size=len(value), crc32=zlib.crc32(value), offsets=offsets)
    assert ns["joined"](decoded, dict(zip(offsets, chunks))) == value
    with pytest.raises(ValueError, match="do not match"):
        ns["joined"](decoded, dict(zip(offsets, [chunks[0][:-1], *chunks[1:]])))


def test_documented_subscriber_frees_a_trajectory_at_its_end_step_or_its_trajectory_end():
    """A trajectory ended by ``complete_trajectory`` (a TrajectoryEnd; no step of it says is_last) leaves
    nothing in the subscriber's memory, nor does one ended by its is_last step; the writer forgets
    a trajectory at either, so a step of it after them is a keyframe and still reads."""
    ns, encoder, contexts = documented_subscriber(), PrefixEncoder(), {}
    by_end = trajectory("by-end", 4)
    by_end[-1].is_last = False
    values = [codec.encode(encoder.delta(step)) for step in by_end]
    assert [ns["step_body"](v, 4)[0]["prompt_form"] for v in values] == [0, 1, 1, 1]
    encoder.forget("by-end")  # what StepProducer does as it encodes the end (streams/client/producer.py _encode)
    values.append(codec.encode(TrajectoryEnd("by-end", "p", reward=1.0)))
    decoded = [ns["decode"](value, contexts, None) for value in values[:-1]]
    assert [(d["prompt_ids"], d["is_last"]) for d in decoded] == [(s.prompt_ids, False) for s in by_end]
    assert contexts, "the trajectory's contexts are kept while it runs"
    assert ns["decode"](values[-1], contexts, None)["kind"] == "end"
    assert contexts == {}, "a trajectory ended by a TrajectoryEnd is freed"
    for step in trajectory("by-last", 3):
        ns["decode"](codec.encode(encoder.delta(step)), contexts, None)
    assert contexts == {}, "a trajectory ended by its is_last step is freed"
    late = codec.encode(encoder.delta(trajectory("by-end", 6)[5]))  # a step of it sent after its end
    assert ns["decode"](late, contexts, None)["prompt_ids"] == trajectory("by-end", 6)[5].prompt_ids


def test_documented_subscriber_reports_a_step_whose_keyframe_it_never_read_and_goes_on():
    """Started mid-trajectory (or after retention deleted the keyframe), the subscriber reports each
    step it cannot resolve, guesses no prompt, and reads the trajectory again from its next keyframe."""
    ns, encoder, contexts = documented_subscriber(), PrefixEncoder(keyframe_every=3), {}
    steps = trajectory("t", 7)
    values = [codec.encode(encoder.delta(step)) for step in steps]
    assert [ns["step_body"](v, 4)[0]["prompt_form"] for v in values] == [0, 1, 1, 0, 1, 1, 0]
    decoded = [ns["decode"](value, contexts, None) for value in values[1:]]  # step 0, the keyframe, is gone
    assert [d["kind"] for d in decoded] == ["unresolved_step", "unresolved_step", "step", "step", "step", "step"]
    assert [d["step_index"] for d in decoded] == [1, 2, 3, 4, 5, 6]
    assert [d["prompt_ids"] for d in decoded[2:]] == [s.prompt_ids for s in steps[3:]]
    assert contexts == {}


def test_documented_group_decoder_refuses_a_step_that_does_not_fill_its_stated_length():
    """A group's step body occupies exactly the length before it (``codec._read_group``: ``body.done()``)."""
    ns = documented_subscriber()
    value = codec.encode(ReadyGroup("p", "train", trajectory("t0", 2), 1, ready_at=1.0))
    assert ns["group_body"](value, 4)[1] == len(value)
    _shared, entries = structure(trajectory("t0", 2))
    body = codec.encode_group_body(ReadyGroup("p", "train", [], 1, ready_at=1.0), _shared, entries)
    first = codec._step_body(entries[0])
    padded = body.replace(codec._uvarint(len(first)) + first, codec._uvarint(len(first) + 1) + first + b"\0")
    assert padded != body
    with pytest.raises(codec.DecodeError, match="trailing bytes"):  # what the doc describes: trajbus refuses it
        codec.decode(codec.preamble(codec.KIND_READY_GROUP) + padded)
    with pytest.raises(ValueError, match="length"):
        ns["group_body"](codec.preamble(codec.KIND_READY_GROUP) + padded, 4)


def anchor(heading: str) -> str:
    """The anchor mkdocs gives a heading."""
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


def test_the_doc_maps_every_section_to_its_module_in_streams_wire_and_every_module_to_a_section():
    """The page is the map of one folder: its table names, per section, the module that encodes it."""
    contract = DOC.read_text().split("## Decoding without trajbus")[0]
    table = contract.split("## Topics and keys")[0]
    linked = set(re.findall(r"\]\(#([a-z0-9-]+)\)", table))
    assert linked <= {anchor(h) for h in re.findall(r"^#{2,4} (.+)$", contract, re.M)}, "a link to no section"
    sections = {anchor(h) for h in re.findall(r"^## (.+)$", contract, re.M)}
    assert sections <= linked, f"sections the map leaves out: {sorted(sections - linked)}"
    named = set(re.findall(r"`streams/wire/([a-z_]+\.py)`", table))
    folder = {path.name for path in WIRE.glob("*.py")} - {"__init__.py"}
    assert named == folder, f"modules the map names: {sorted(named)}; streams/wire has {sorted(folder)}"
    for section in re.split(r"^## ", contract, flags=re.M)[1:]:
        assert "`streams/wire/" in section, f"section {section.splitlines()[0]!r} names no module of streams/wire"


def test_every_header_the_doc_names_is_one_streams_wire_names_and_no_other():
    constants = {value for module in (headers, dlq) for name, value in vars(module).items()
                 if name.isupper() and isinstance(value, str)}
    documented = set(re.findall(r"`(trajbus-[a-z-]+)`", DOC.read_text()))
    assert documented == {value for value in constants if value.startswith("trajbus-")}
    assert {headers.CONTENT_TYPE, headers.TRACEPARENT} <= set(re.findall(r"`([a-z-]+)`", DOC.read_text()))
