"""docs/wire-format.md is precise enough to decode a record: its standard-library decoder must agree."""

from __future__ import annotations

import re
from pathlib import Path

from streams import codec
from streams.records import Step

DOC = Path(__file__).resolve().parents[1] / "docs" / "wire-format.md"


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
    from streams.records import ReadyGroup

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


BLOCK_TRAJBUS = """
import sys
class _NoTrajbus:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("streams", "consumers", "infra", "gateway", "pipelines", "tests"):
            raise ImportError(f"the subscriber example must not import trajbus ({name})")
sys.meta_path.insert(0, _NoTrajbus())
"""


def test_the_documented_plain_kafka_subscriber_decodes_steps_and_groups(bootstrap_servers, prefix, start_worker,
                                                                        tmp_path):
    import json
    import subprocess
    import sys

    from pipelines.synthetic import make_groups
    from streams.producer import StepProducer
    from tests.helpers import through_worker, wait_for

    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    helpers = blocks[0].split("value = ...")[0]
    script = tmp_path / "subscriber.py"
    script.write_text(BLOCK_TRAJBUS + helpers + blocks[1])
    sent, stream = make_groups(3, 2, 2, seed=4)
    through_worker(bootstrap_servers, prefix, start_worker, stream, n_rollouts=2)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.complete_trajectory("extra-t", sorted(sent)[0], reward=None)  # an end without a reward

    def run() -> list[dict]:
        out = subprocess.run([sys.executable, str(script), bootstrap_servers, prefix, "train"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    records = wait_for(lambda: (r := run()) and sum(x["kind"] == "group" for x in r) == 3 and r, 60,
                       "three groups for the plain subscriber")
    steps = [r for r in records if r["kind"] == "step"]
    by_key = {(s.trajectory_uid, s.step_index): s for group in sent.values() for s in group}
    assert len(steps) == len(stream)
    for decoded in steps:
        original = by_key[(decoded["trajectory_uid"], decoded["step_index"])]
        assert decoded["key"] == original.prompt_uid
        assert (decoded["prompt_ids"], decoded["response_ids"], decoded["reward"], decoded["is_last"]) == \
            (original.prompt_ids, original.response_ids, original.reward, original.is_last)
        assert decoded["rollout_log_probs"] == original.rollout_log_probs
    [end] = [r for r in records if r["kind"] == "end"]
    assert end["trajectory_uid"] == "extra-t" and end["reward"] is None
    groups = {r["prompt_uid"]: r for r in records if r["kind"] == "group"}
    assert set(groups) == set(sent)
    for uid, group in groups.items():
        assert [(s["trajectory_uid"], s["step_index"], s["response_ids"]) for s in group["steps"]] == \
            sorted((s.trajectory_uid, s.step_index, s.response_ids) for s in sent[uid])
        assert group["status"] == "complete" and group["n_rollouts"] == 2
