"""verl's default trainer (V1) on trajbus: ``trajbus.VerlAgentLoopManager`` feeds verl's TransferQueue.

One scripted engine, one stream worker and one gateway serve the file; verl's TransferQueue runs on a local
Ray cluster in this process, as in verl's task runner. The engine answers a calculator tool call, then a
final answer, so each of the calculator agents' trajectories has a tool turn (loss-masked) between two model
turns. verl's own ``ReplayBuffer`` samples what the manager wrote, and the rows read back from
TransferQueue are compared with what ``BatchConsumer.fetch_dataproto`` gives for the same groups.
"""

from __future__ import annotations

import signal
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.verl.settings import VerlQueueSettings
from trajbus.infra import ray_exit
from trajbus.pipelines.processes import free_port, gateway_process, scripted_engine_process, wait_http, worker_process
from trajbus.pipelines.slime.harness import SAMPLE_INDEX
from trajbus.pipelines.verl import VerlAgentLoopManager
from trajbus.streams.client.producer import StepProducer
from tests.helpers import wait_for
from tests.verl_v1 import register, replay_buffer, verl_batch, verl_config

ROOT = Path(__file__).resolve().parents[2]
CHANNELS = ("v1train", "v1val", "v1fail")
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
REPLIES = [TOOL_CALL, "It is 42."]
N = 4


@dataclass
class Stack:
    servers: str
    prefix: str
    gateway_url: str
    model_dir: Path


@pytest.fixture(scope="module")
def stack(bootstrap_servers: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prefix, logs = f"t{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("verl-v1")
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        for channel in CHANNELS:
            producer.provision(channel)
    engine_port, gateway_port = free_port(), free_port()
    started = [scripted_engine_process(engine_port, logs, tiny_model_dir, REPLIES, workers=8).start(),
               worker_process(bootstrap_servers, prefix, logs / "worker.log", channels=",".join(CHANNELS)).start(),
               gateway_process(bootstrap_servers, prefix, [f"127.0.0.1:{engine_port}"], tiny_model_dir, gateway_port,
                               logs / "gateway-state", logs / "gateway.log",
                               ["--prompt-length", "768", "--response-length", "256", "--health-interval", "0.5"]
                               ).start()]
    try:
        wait_http(f"http://127.0.0.1:{gateway_port}/ready", 120, started[-1])
        yield Stack(bootstrap_servers, prefix, f"http://127.0.0.1:{gateway_port}", tiny_model_dir)
    finally:
        for process in started:
            if process.alive():
                process.process.send_signal(signal.SIGTERM)
        for process in started:
            process.stop()


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
