"""verl's default trainer (V1) on trajbus: ``trajbus.VerlAgentLoopManager`` feeds verl's TransferQueue.

One scripted engine, one stream worker and one gateway serve the file; verl's TransferQueue runs on a local
Ray cluster in this process, as in verl's task runner. The engine answers a calculator tool call, then a
final answer, so each of the calculator agents' trajectories has a tool turn (loss-masked) between two model
turns. verl's own ``ReplayBuffer`` samples what the manager wrote, and the rows read back from
TransferQueue are compared with what ``BatchConsumer.fetch_dataproto`` gives for the same groups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from transformers import AutoTokenizer

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.verl.settings import VerlQueueSettings
from trajbus.infra import ray_exit
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.slime.harness import SAMPLE_INDEX
from trajbus.pipelines.verl import VerlAgentLoopManager
from tests.helpers import agent_stack, audit_report, wait_for
from tests.verl_v1 import MANAGER, MANAGER_KEY, register, replay_buffer, verl_batch, verl_config

ROOT = Path(__file__).resolve().parents[2]
CHANNELS = ("v1train", "v1val", "v1fail", "v1crash", "v1async")
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
REPLIES = [TOOL_CALL, "It is 42."]
N = 4


@dataclass
class Stack:
    servers: str
    prefix: str
    gateway_url: str
    model_dir: Path
    engine: str


@pytest.fixture(scope="module")
def stack(bootstrap_servers: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prefix, logs = f"t{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("verl-v1")
    with agent_stack(bootstrap_servers, prefix, CHANNELS, tiny_model_dir, logs, REPLIES,
                     ["--prompt-length", "768", "--response-length", "256", "--health-interval", "0.5"]
                     ) as (url, engine_port):
        yield Stack(bootstrap_servers, prefix, url, tiny_model_dir, f"127.0.0.1:{engine_port}")


@pytest.fixture(scope="module")
def tq(stack: Stack) -> Iterator[Any]:
    """TransferQueue on a fresh local Ray cluster, initialised as verl's ``TaskRunnerV1.run`` does."""
    ray_exit.connect(num_cpus=4, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    import ray
    import transfer_queue

    transfer_queue.init(verl_config(stack.model_dir, N, 3).transfer_queue)
    yield transfer_queue
    transfer_queue.close()
    ray.shutdown()


@pytest.fixture
def manager(stack: Stack, tq: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
            ) -> Iterator[VerlAgentLoopManager]:
    monkeypatch.setenv("TRAJBUS_BOOTSTRAP_SERVERS", stack.servers)
    agent = getattr(request, "param", "trajbus.pipelines.slime.agents.calculator_agent")
    channel = "v1fail" if "failing" in agent else "v1train"
    settings = VerlQueueSettings(prefix=stack.prefix, channel=channel, val_channel="v1val",
                                 gateway_url=stack.gateway_url, agent=agent, agent_concurrency=16)
    config = verl_config(stack.model_dir, N, 3, [f"trainer.experiment_name={uuid.uuid4().hex[:8]}"])
    with_manager = VerlAgentLoopManager(config, settings=settings)
    yield with_manager
    with_manager.close()


def statuses(tq: Any, partition: str, uids: list[str]) -> dict[str, str]:
    tags = (tq.kv_list(partition) or {}).get(partition, {})
    return {uid: tags[uid].get("status") for uid in uids if uid in tags}


def groups_from_kafka(stack: Stack, channel: str, count: int) -> dict[str, Any]:
    """Each group of the channel as ``fetch_dataproto`` converts it (one row per trajectory)."""
    backend = VerlBackend(768, 256, row_mode="trajectory")
    with BatchConsumer(channel, stack.servers, prefix=stack.prefix, group_id=f"{stack.prefix}.check",
                       backend=backend, rank=0, world_size=1) as reader:
        batches = [reader.fetch_dataproto(1, timeout=30) for _ in range(count)]
    assert all(batch is not None for batch in batches)
    return {str(batch.non_tensor_batch["uid"][0]): batch for batch in batches}


def test_groups_of_tool_calling_agents_are_sampled_by_verls_replay_buffer_with_fetch_dataprotos_tensors(
        stack, tq, manager):
    config = manager.config
    batch = verl_batch([0, 1, 2], step=1)
    uids = register(tq, batch, step=1)
    manager.generate_sequences(batch)
    sampled, metrics = replay_buffer(config, 3).sample(global_steps=1, partition_id="train", batch_size=3)

    assert sorted(sampled.keys) == sorted(f"{uid}_{s}_0" for uid in uids for s in range(N))
    assert all(tag["status"] == "success" and tag["min_global_steps"] == 0 for tag in sampled.tags)
    fields = ["uid", "session_id", "index", "input_ids", "position_ids", "response_mask", "loss_mask",
              "rollout_log_probs", "rm_scores", "prompts", "responses"]
    data = tq.kv_batch_get(keys=sampled.keys, partition_id=sampled.partition_id, select_fields=fields)
    expected = groups_from_kafka(stack, "v1train", 3)
    assert set(expected) == set(uids)  # the group's prompt_uid is verl's uid: GRPO groups by it
    tool_turns = 0
    for i, key in enumerate(sampled.keys):
        uid, session = key.split("_")[0], int(key.split("_")[1])
        assert data["uid"][i] == uid and data["session_id"][i] == session
        assert data["index"][i] == uids.index(uid)
        dp = expected[uid]
        row = list(dp.non_tensor_batch[SAMPLE_INDEX]).index(session)
        attention = dp.batch["attention_mask"][row].bool()
        r = int(dp.batch["responses"].shape[1] - (~attention[-dp.batch["responses"].shape[1]:]).sum())
        assert torch.equal(data["input_ids"][i], dp.batch["input_ids"][row][attention])
        assert torch.equal(data["position_ids"][i], dp.batch["position_ids"][row][attention])
        for name in ("response_mask", "rollout_log_probs", "rm_scores"):
            assert torch.equal(data[name][i], dp.batch[name][row, :r]), name
        assert torch.equal(data["loss_mask"][i], data["response_mask"][i])
        tool_turns += 0 in data["response_mask"][i].tolist()  # a tool's turn is in the response, masked out
    assert tool_turns > 0
    tq.kv_clear(keys=sampled.keys, partition_id="train")


def test_validation_prompts_go_through_the_val_channel_into_the_val_partition(stack, tq, manager):
    batch = verl_batch([5, 6], step=0)
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor_data(batch, "validate", True)
    uids = register(tq, batch, step=0, partition="val")
    manager.generate_sequences(batch)
    wait_for(lambda: set(statuses(tq, "val", uids).values()) == {"finished"}, 120, "validation groups finished")
    tags = tq.kv_list("val")["val"]
    keys = sorted(key for key in tags if not tags[key].get("is_prompt"))
    assert keys == sorted(f"{uid}_{s}_0" for uid in uids for s in range(2))  # val_kwargs.n
    assert groups_from_kafka(stack, "v1val", 2).keys() == set(uids)
    tq.kv_clear(keys=[*uids, *keys], partition_id="val")


@pytest.mark.parametrize("manager", ["tests.verl_v1.failing_agent"], indirect=True)
def test_a_prompt_whose_agents_fail_is_tagged_failure_with_the_workers_reason(stack, tq, manager):
    batch = verl_batch([9], step=1)
    uids = register(tq, batch, step=1)
    manager.generate_sequences(batch)
    wait_for(lambda: statuses(tq, "train", uids) == {uids[0]: "failure"}, 120, "the prompt tagged failure")
    tag = tq.kv_list("train")["train"][uids[0]]
    assert "dropped" in tag["reason"] and "agent failed" in tag["reason"], tag
    assert manager.feeders["train"].failed == 1
    tq.kv_clear(keys=uids, partition_id="train")


def test_the_one_key_on_verls_config_builds_trajbus_manager_in_verls_task_runner(stack, tmp_path):
    """Only the key set, in a fresh Ray cluster in a subprocess: verl's ``TaskRunnerV1.init_agent_loop_manager``
    builds trajbus's manager, which starts a gateway at the inference server verl's load balancer lists and a
    worker, and the step's groups land in TransferQueue under verl's keys, each prompt ``finished``."""
    env = {**os.environ, "TRAJBUS_BOOTSTRAP_SERVERS": stack.servers, "TRAJBUS_VERL_PREFIX": stack.prefix,
           "TRAJBUS_VERL_CHANNEL": "v1layout", "TRAJBUS_VERL_VAL_CHANNEL": "v1layoutval",
           "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "verl_v1_layout_driver.py"), stack.engine,
                           str(stack.model_dir), f"{MANAGER_KEY}={MANAGER}",
                           f"trainer.default_local_dir={tmp_path}"],
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["manager"] == "trajbus.pipelines.verl.manager.VerlAgentLoopManager"
    assert result["own_services"] and result["gateway"] != stack.gateway_url
    assert result["statuses"] == ["finished", "finished"]
    assert result["keys"] == result["expected_keys"]
    assert (tmp_path / "trajbus" / "gateway.log").is_file()


@pytest.fixture
def recorded_gateway(stack: Stack, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A gateway (on the file's worker) at an engine of its own that records every prompt it is sent and
    answers each call at once, one call per trajectory: the engine's calls per prompt are countable."""
    record = tmp_path / "engine-calls.jsonl"
    with agent_stack(stack.servers, stack.prefix, (), stack.model_dir, tmp_path, ["It is 42."],
                     ["--prompt-length", "768", "--response-length", "256"], record=record) as (url, _):
        yield url, record


def calls_per_index(record: Path, model_dir: Path) -> dict[int, int]:
    """The engine's calls by the dataset index their prompt names ("What is 6 * 7? (i)")."""
    import re

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    counts: dict[int, int] = {}
    for line in record.read_text().splitlines():
        index = int(re.findall(r"\? \((\d+)\)", tokenizer.decode(json.loads(line)["prompt_ids"]))[0])
        counts[index] = counts.get(index, 0) + 1
    return counts


def printed(process: subprocess.Popen, line: str, timeout: float) -> bool:
    """Whether ``process`` printed ``line`` (verl prints lines of its own too) within ``timeout``."""
    seen = threading.Event()

    def read() -> None:
        for got in process.stdout:
            if got.strip() == line:
                seen.set()
                return

    threading.Thread(target=read, daemon=True).start()
    return seen.wait(timeout)


def run_driver(stack: Stack, gateway: str, workdir: Path, stop_at: int) -> subprocess.Popen:
    env = {**os.environ, "TRAJBUS_BOOTSTRAP_SERVERS": stack.servers, "TRAJBUS_VERL_PREFIX": stack.prefix,
           "TRAJBUS_VERL_CHANNEL": "v1crash", "TRAJBUS_VERL_GATEWAY_URL": gateway, "PYTHONPATH": str(ROOT),
           "TRAJBUS_VERL_AGENT": "tests.verl_v1.gated_agent",
           "RAY_ADDRESS": ""}
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "verl_v1_crash_driver.py"), str(workdir),
                             str(stack.model_dir), str(stop_at)], env=env, stdout=subprocess.PIPE,
                            stderr=open(workdir / f"driver-{stop_at}.log", "w"), text=True, start_new_session=True)


def test_a_kill_9_mid_step_resumed_from_the_checkpoint_trains_each_prompt_once_and_regenerates_none(
        stack, recorded_gateway, tmp_path):
    """Checkpoints at step 2; the trainer is killed (its whole process group, Ray included) in step 3, one of
    the step's groups ready, the other's agents waiting mid-trajectory. The resumed trainer draws step 3's
    prompts again under new uids: the manager finds both on the ledger, writes the ready group from Kafka and
    generates the cut one again (the worker dropped it when the manager abandoned it)."""
    gateway, record = recorded_gateway
    first = run_driver(stack, gateway, tmp_path, stop_at=3)
    try:
        assert printed(first, "READY 3", 300), (tmp_path / "driver-3.log").read_text()[-3000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    before = sum(calls_per_index(record, stack.model_dir).values())
    assert [json.loads(line)["step"] for line in (tmp_path / "trained.jsonl").read_text().splitlines()] == [1, 2]

    second = run_driver(stack, gateway, tmp_path, stop_at=0)
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, (tmp_path / "driver-0.log").read_text()[-3000:]
    counts = json.loads(out.strip().splitlines()[-1])
    trained = [json.loads(line) for line in (tmp_path / "trained.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in trained] == [1, 2, 3, 4]
    assert sorted(i for entry in trained for i in entry["indices"]) == list(range(8))  # each prompt once
    assert counts == {"resumed": 1, "written": 4}  # step 3's ready group came from Kafka
    assert calls_per_index(record, stack.model_dir) == {i: 2 for i in range(8)}  # n = 2 calls each, no more
    assert before == 5 * 2  # steps 1-2 and step 3's ready prompt were generated before the kill
    with PromptLedger(stack.servers, "v1crash", stack.prefix) as ledger:
        ledger.refresh()
        reissued = [d for d in ledger.view.dispatched.values() if d.source == "reissue"]
        abandoned = [uid for uid in ledger.view.dispatched if ledger.view.dropped_for(uid) == "abandoned"]
    assert len(reissued) == 1 and [reissued[0].origin] == abandoned  # the cut group, generated once more
    code, report = audit_report(stack.servers, stack.prefix, "v1crash")
    assert (code, report["steps"], report["violations"]) == (0, 4, []), report["violations"]
    at = sorted((fate["steps"], fate["prompt_uid"]) for fate in report["prompts"] if fate["status"] == "trained")
    assert [steps for steps, _ in at] == [[1], [1], [2], [2], [3], [3], [4], [4]], "each group at its step, once"


def test_an_async_reissue_keeps_its_uid_and_is_written_from_kafka(stack, tq, recorded_gateway, monkeypatch):
    """verl's async modes restore the in-flight prompts from their checkpoint and re-issue them under their
    own uid with the resumed step: a new manager (the trainer restarted) finds them by uid."""
    gateway, record = recorded_gateway
    monkeypatch.setenv("TRAJBUS_BOOTSTRAP_SERVERS", stack.servers)
    settings = VerlQueueSettings(prefix=stack.prefix, channel="v1async", val_channel="v1val", gateway_url=gateway)
    config = verl_config(stack.model_dir, N, 2, ["trainer.experiment_name=async"])
    batch = verl_batch([0, 1], step=3)
    uids = register(tq, batch, step=3)
    first = VerlAgentLoopManager(config, settings=settings)
    try:
        first.generate_sequences(batch)
        wait_for(lambda: set(statuses(tq, "train", uids).values()) == {"finished"}, 120, "the groups finished")
    finally:
        first.close()
    keys = [key for key, tag in tq.kv_list("train")["train"].items() if not tag.get("is_prompt")]
    tq.kv_clear(keys=keys, partition_id="train")
    calls = record.read_text().count("\n")

    again = verl_batch([0, 1], step=5, uids=uids)  # _reissue_inflight_prompts: same uids, the resumed step
    register(tq, again, step=5)
    second = VerlAgentLoopManager(config, settings=settings)
    try:
        second.generate_sequences(again)
        assert set(statuses(tq, "train", uids).values()) == {"finished"}  # written before generate returned
        assert second.resumed == 2 and record.read_text().count("\n") == calls == 2 * N
        tags = tq.kv_list("train")["train"]
        assert sorted(key for key in tags if not tags[key].get("is_prompt")) == sorted(keys)
        assert {tags[key]["global_steps"] for key in keys} == {5}
    finally:
        second.close()
    tq.kv_clear(keys=[*uids, *keys], partition_id="train")
