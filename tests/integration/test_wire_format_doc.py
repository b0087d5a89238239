"""The plain-Kafka subscriber of docs/wire-format.md decodes a real channel without importing trajbus."""

from __future__ import annotations

from pathlib import Path

from pytest_codeblocks import extract_from_file

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-format.md"


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
    import time

    from confluent_kafka import Producer

    from trajbus.pipelines.synthetic import make_groups
    from trajbus.streams.client.chunks import produce_group
    from trajbus.streams.wire.chunks import RECORD_OVERHEAD
    from trajbus.streams.wire.records import ReadyGroup
    from trajbus.streams.wire.topics import chunks_topic, groups_topic
    from trajbus.streams.client.producer import StepProducer
    from tests.helpers import read_to_end, through_worker, wait_for
    from tests.unit.test_prefix import trajectory

    blocks = [block.code for block in extract_from_file(DOC) if block.syntax == "python"]  # the doc's own code
    helpers = blocks[0].split("value = ...")[0]
    script = tmp_path / "subscriber.py"
    script.write_text(BLOCK_TRAJBUS + helpers + blocks[1])
    sent, stream = make_groups(3, 2, 2, seed=4)
    multi_turn = [trajectory(f"mt/r{r}", 4, start=time.time()) for r in range(2)]  # stored as deltas
    for r, steps in enumerate(multi_turn):
        for step in steps:
            step.prompt_uid, step.reward = "mt", float(r) if step.is_last else 0.0
    sent["mt"] = [s for t in multi_turn for s in t]
    stream += sorted(sent["mt"], key=lambda s: s.step_index)
    through_worker(bootstrap_servers, prefix, start_worker, stream, n_rollouts=2)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.complete_trajectory("extra-t", sorted(sent)[0], reward=None)  # an end without a reward
    chunked = [s for r in range(2) for s in trajectory(f"big/r{r}", 3, start=time.time())]
    for step in chunked:
        step.prompt_uid = "big"
    sent["big"] = chunked
    raw = Producer({"bootstrap.servers": bootstrap_servers})  # as a replay writes a group over the record limit
    produce_group(raw, groups_topic("train", prefix), chunks_topic("train", prefix),
                  ReadyGroup("big", "train", chunked, 2), [], RECORD_OVERHEAD + 100, lambda error, _m: None)
    assert raw.flush(30) == 0
    raw.close()

    def run() -> list[dict]:
        out = subprocess.run([sys.executable, str(script), bootstrap_servers, prefix, "train"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    records = wait_for(lambda: (r := run()) and sum(x["kind"] == "group" for x in r) == 5 and r, 60,
                       "five groups for the plain subscriber")
    steps = [r for r in records if r["kind"] == "step"]
    by_key = {(s.trajectory_uid, s.step_index): s for uid, group in sent.items() if uid != "big" for s in group}
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
        assert [(s["trajectory_uid"], s["step_index"], s["prompt_ids"], s["response_ids"]) for s in group["steps"]] \
            == sorted((s.trajectory_uid, s.step_index, s.prompt_ids, s.response_ids) for s in sent[uid])
        assert group["status"] == "complete" and group["n_rollouts"] == 2
    assert read_to_end(bootstrap_servers, chunks_topic("train", prefix)), "the big group travelled in chunks"
