"""docs/wire-format.md is precise enough to decode a record: its standard-library decoder must agree."""

from __future__ import annotations

import re
from pathlib import Path

from trajbus.streams import codec
from trajbus.streams.records import Step

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-format.md"


def documented_decoder() -> dict:
    block = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    definitions = block.split("value = ...")[0]
    namespace: dict = {}
    exec(definitions, namespace)  # the doc's own code, with no trajbus import
    return namespace


def test_documented_step_decoder_reads_what_the_codec_writes():
    step_body = documented_decoder()["step_body"]
    for top in (200, 60000, 150000):
        step = Step(prompt_ids=[top, 1, 2], response_ids=[3, top], trajectory_uid="tr-é", prompt_uid="p",
                    step_index=4, reward=-1.25, policy_version=3, is_last=True, metadata={"k": "v"},
                    rollout_log_probs=[-0.5, -2.0], channel="train", n_rollouts=4)
        value = codec.encode(step)
        assert value[:2] == b"TB" and value[2] == 1 and value[3] == 1
        decoded, end = step_body(value, 4)
        assert end == len(value)
        assert decoded == dict(trajectory_uid="tr-é", prompt_uid="p", step_index=4, reward=-1.25, is_last=True,
                               prompt_ids=[top, 1, 2], response_ids=[3, top], rollout_log_probs=[-0.5, -2.0],
                               metadata={"k": "v"})


def test_documented_decoder_reads_the_steps_inside_a_ready_group():
    ns = documented_decoder()
    steps = [Step(prompt_ids=[1], response_ids=[i], trajectory_uid=f"t{i}", prompt_uid="p") for i in range(3)]
    from trajbus.streams.records import ReadyGroup

    value = codec.encode(ReadyGroup("p", "train", steps, 3, ready_at=1.0))
    pos = 4
    prompt_uid, pos = ns["string"](value, pos)
    channel, pos = ns["string"](value, pos)
    pos += 12  # n_rollouts u32 + ready_at f64
    status, pos = ns["string"](value, pos)
    _meta, pos = ns["string"](value, pos)
    count, pos = ns["uvarint"](value, pos)
    uids = []
    for _ in range(count):
        length, pos = ns["uvarint"](value, pos)
        step, end = ns["step_body"](value[pos:pos + length])
        assert end == length
        uids.append(step["trajectory_uid"])
        pos += length
    assert (prompt_uid, channel, status, uids, pos) == ("p", "train", "complete", ["t0", "t1", "t2"], len(value))
