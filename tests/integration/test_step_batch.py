"""The batch of step N: a trainer trains 6 steps on gateway-fed groups, is killed and resumed once, and every
step's batch read back from the trained log is the batch it trained, tensor for tensor."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
import torch
from confluent_kafka import Producer

from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.replay import Replay
from trajbus.infra.topics import ensure_topics
from trajbus.pipelines.processes import ServiceProcess
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.topics import groups_topic, trained_topic
from tests.helpers import audit_report, read_to_end, trajbus, wait_for
from tests.step_trainer import BACKEND, RUN

ROOT = Path(__file__).resolve().parents[2]
GROUPS = 14
"""6 steps of 2 groups, one step trained twice (the kill), and 2 left over."""


def run_group(gateway: str, prompt_uid: str) -> None:
    """Two agents of one prompt, two turns each, through the gateway."""
    for _ in range(2):
        trajectory = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": prompt_uid, "n_rollouts": 2}).json()
        client = openai.OpenAI(base_url=trajectory["base_url"], api_key="agent", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": f"{prompt_uid}: 3 + 4?"}]
        for turn in range(2):
            reply = client.chat.completions.create(model="tiny", messages=messages).choices[0].message.content
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"and {turn}?"}]
        assert httpx.post(f"{trajectory['base_url']}/complete_trajectory", json={"reward": 1.0}).status_code == 200


def trainer(servers: str, prefix: str, tmp_path: Path, *extra: str) -> ServiceProcess:
    count = len(list(tmp_path.glob("trainer*.log")))
    return ServiceProcess(["--bootstrap-servers", servers, "--prefix", prefix, "--dir", str(tmp_path), *extra],
                          tmp_path / f"trainer{count}.log", env={"PYTHONPATH": str(ROOT)},
                          module="tests.step_trainer").start()


def trained(process: ServiceProcess) -> list[int]:
    return [int(line.split()[1]) for line in process.log_file.read_text().splitlines() if line.startswith("trained ")]


def test_every_step_replays_the_batch_it_trained_tensor_for_tensor_across_a_kill(
        bootstrap_servers, prefix, start_worker, scripted_engine, start_gateway, tmp_path):
    start_worker(n_rollouts=2)
    engine, _ = scripted_engine(["It is 7.", "It is 11.", "Sure."])
    gateway, _ = start_gateway([engine], ["--prompt-length", "512", "--response-length", "64"])
    for index in range(GROUPS):
        run_group(gateway, f"q{index:02d}")

    first = trainer(bootstrap_servers, prefix, tmp_path, "--hold-after", "3")
    try:
        wait_for(lambda: 3 in trained(first) or not first.alive() or None, 180, "step 3 trained")
        first.kill()  # after step 3, past the checkpoint of step 2: the resume trains step 3 again
        assert trained(first) == [1, 2, 3], first.log_tail()
        second = trainer(bootstrap_servers, prefix, tmp_path)
        wait_for(lambda: not second.alive() or None, 180, "the resumed trainer's last step")
        assert trained(second) == [3, 4, 5, 6], second.log_tail()
    finally:
        first.kill()

    replay = Replay("train", bootstrap_servers, prefix=prefix)
    with replay:
        for step in range(1, 7):
            got = torch.load(tmp_path / f"batch-{step}.pt", weights_only=False)
            again = replay.batch_of_step(step, run=RUN, as_="dataproto", backend=VerlBackend(**BACKEND))
            assert set(again.batch.keys()) == set(got["tensors"]), step
            for key, tensor in got["tensors"].items():
                assert torch.equal(again.batch[key], tensor), (step, key)
            assert set(again.non_tensor_batch) == set(got["columns"]), step
            for key, values in got["columns"].items():
                assert list(again.non_tensor_batch[key]) == values or \
                    all(np.array_equal(a, b) for a, b in zip(again.non_tensor_batch[key], values)), (step, key)
        groups = [g.prompt_uid for step in range(1, 7) for g in replay.batch_of_step(step, run=RUN)]
    assert len(groups) == len(set(groups)) == 12, "each step its own groups, the re-trained step 3 once"

    listed = trajbus("replay", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--channel", "train",
                     "--step", "3")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].startswith(f"step 3 of run {RUN} (batch_consumer, policy version 2): 2 groups")
    assert [line.split()[0] for line in lines[1:]] == groups[4:6]
    assert_a_copy_elsewhere_finds_each_step_by_key(bootstrap_servers, prefix, groups)

    code, report = audit_report(bootstrap_servers, prefix)  # no ledger: the groups topic is what was emitted
    assert (code, report["run"], report["steps"], report["counts"]) == (0, RUN, 6, {"trained": 12, "waiting": 2})
    unknown = trajbus("audit", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--run", "nope")
    assert (unknown.returncode, unknown.stderr.strip()) == (
        2, f"trajbus audit: run: 'nope' recorded no step on {prefix}.trained.train; runs there: {RUN}")

    missing = trajbus("replay", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--channel", "train",
                      "--step", "9")
    assert (missing.returncode, missing.stderr.strip()) == (
        2, f"trajbus replay: step: run {RUN!r} has no step 9 on record (steps 1..6)")


def assert_a_copy_elsewhere_finds_each_step_by_key(servers: str, prefix: str, groups: list[str]) -> None:
    """The groups topic copied in another order (its offsets differ, as on a mirror) and the trained log as it
    is: every step's groups are found by their keys."""
    copy = f"{prefix}-copy"
    with StepProducer(servers, prefix=copy) as producer:
        producer.provision("train")
    ensure_topics(servers, [TopicSettings(prefix=copy).trained_spec("train")])
    records = read_to_end(servers, groups_topic("train", prefix))
    trained = read_to_end(servers, trained_topic("train", prefix))
    writer = Producer({"bootstrap.servers": servers})
    for message in reversed(records):
        writer.produce(groups_topic("train", copy), key=message.key(), value=message.value(), headers=message.headers())
    for message in trained:
        writer.produce(trained_topic("train", copy), key=message.key(), value=message.value())
    assert writer.flush(30) == 0
    with Replay("train", servers, prefix=copy) as replay:
        found = [g.prompt_uid for step in range(1, 7) for g in replay.batch_of_step(step, run=RUN)]
    assert found == groups
