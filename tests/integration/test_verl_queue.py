"""trajbus's MessageQueue against verl's own: the same calls give the same returns (except where trajbus
never drops), and ``TRAJBUS_VERL_QUEUE`` swaps it into verl's process layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from tests.helpers import read_to_end
from trajbus.infra import ray_exit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A fresh local Ray cluster; each queue actor asks for 2 CPUs, as verl's does."""
    ray_exit.connect(num_cpus=6, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    import ray

    yield ray
    ray.shutdown()


def rollout_sample(i: int) -> bytes:
    """What verl's rollouter puts: a pickled RolloutSample holding a DataProto."""
    import ray
    from verl import DataProto
    from verl.experimental.fully_async_policy.detach_utils import RolloutSample

    batch = DataProto.from_dict(tensors={"responses": torch.full((2, 4), i)},
                                non_tensors={"uid": np.array([f"uid_sample_{i}"] * 2, dtype=object)})
    return ray.cloudpickle.dumps(RolloutSample(full_batch=batch, sample_id=f"sample_{i}", epoch=0, rollout_status={}))


def verl_config(name: str, tmp_path: Path) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "trainer": {"project_name": "differential", "experiment_name": name, "resume_mode": "auto",
                    "default_local_dir": str(tmp_path / name)},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}},
        "async_training": {"require_batches": 1, "trigger_parameter_sync_step": 1}})


@pytest.fixture
def both_queues(ray_cluster: Any, bootstrap_servers: str, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """make(max_queue_size) -> (verl's MessageQueue actor, trajbus's), on one config."""
    from verl.experimental.fully_async_policy.message_queue import MessageQueue as VerlQueue

    from trajbus.consumers.verl.actor import MessageQueue as TrajbusQueue

    monkeypatch.setenv("TRAJBUS_BOOTSTRAP_SERVERS", bootstrap_servers)
    monkeypatch.setenv("TRAJBUS_VERL_PREFIX", prefix)
    actors = []

    def make(max_queue_size: int, name: str) -> tuple[Any, Any]:
        config = verl_config(name, tmp_path)
        pair = (VerlQueue.remote(config, max_queue_size),
                TrajbusQueue.options(runtime_env={"env_vars": {"TRAJBUS_BOOTSTRAP_SERVERS": bootstrap_servers,
                                                               "TRAJBUS_VERL_PREFIX": prefix}}).remote(config, max_queue_size))
        actors.extend(pair)
        return pair

    yield make
    for actor in actors:
        ray_cluster.kill(actor)


def both(ray: Any, queues: tuple[Any, Any], method: str, *args: Any) -> tuple[Any, Any]:
    return tuple(ray.get([getattr(queue, method).remote(*args) for queue in queues]))


def test_every_call_returns_what_verls_queue_returns(ray_cluster: Any, both_queues: Any) -> None:
    ray = ray_cluster
    queues = both_queues(4, "same")
    samples = [rollout_sample(i) for i in range(3)]

    def same(method: str, *args: Any) -> Any:
        verl, trajbus = both(ray, queues, method, *args)
        assert trajbus == verl, f"{method}{args}: verl {verl!r}, trajbus {trajbus!r}"
        return verl

    assert same("put_sample", samples[0]) is True
    assert same("put_sample", samples[1]) is True
    assert same("get_queue_size") == 2
    assert same("get_statistics") == {"queue_size": 2, "total_produced": 2, "total_consumed": 0,
                                      "dropped_samples": 0, "max_queue_size": 4}
    assert same("get_sample") == (samples[0], 1)
    assert same("put_sample", None) is True  # the rollouter's end-of-stream sentinel
    assert same("get_sample") == (samples[1], 1)
    assert same("get_sample") == (None, 0)
    assert same("put_validate", {"val": 1}) is None
    assert same("get_validate") == {"val": 1}
    assert same("get_validate") is None
    assert same("get_memory_usage") == {"queue_samples": 0, "estimated_memory_bytes": 0, "estimated_memory_mb": 0.0}
    assert same("put_sample", samples[2]) is True
    assert same("clear_queue") is None
    assert same("get_queue_size") == 0
    assert same("get_statistics") == {"queue_size": 0, "total_produced": 4, "total_consumed": 3,
                                      "dropped_samples": 0, "max_queue_size": 4}

    waiting = [queue.get_sample.remote() for queue in queues]
    ready, _ = ray.wait(waiting, num_returns=2, timeout=1.0)
    assert not ready, "get_sample on an empty queue must wait"
    assert same("shutdown") is None
    assert ray.get(waiting) == [None, None]  # a bare None once shut down and empty
    assert same("get_sample") is None


def test_past_max_queue_size_trajbus_keeps_what_verl_drops(ray_cluster: Any, both_queues: Any) -> None:
    """Deliberate difference: verl's full queue drops its oldest sample (put returns False);
    trajbus's keeps every sample on Kafka, and the rollouter paces itself on get_queue_size."""
    ray = ray_cluster
    queues = both_queues(2, "overflow")
    samples = [rollout_sample(i) for i in range(3)]
    puts = [both(ray, queues, "put_sample", sample) for sample in samples]
    assert [verl for verl, _ in puts] == [True, True, False]
    assert [trajbus for _, trajbus in puts] == [True, True, True]
    verl, trajbus = both(ray, queues, "get_statistics")
    assert (verl["queue_size"], verl["dropped_samples"]) == (2, 1)
    assert trajbus == {"queue_size": 3, "total_produced": 3, "total_consumed": 0, "dropped_samples": 0,
                       "max_queue_size": 2}
    verl_got = [ray.get(queues[0].get_sample.remote()) for _ in range(2)]
    trajbus_got = [ray.get(queues[1].get_sample.remote()) for _ in range(3)]
    assert verl_got == [(samples[1], 1), (samples[2], 0)]
    assert trajbus_got == [(samples[0], 2), (samples[1], 1), (samples[2], 0)]


def test_one_setting_swaps_the_queue_in_verls_process_layout(bootstrap_servers: str, prefix: str) -> None:
    """``TRAJBUS_VERL_QUEUE=kafka`` and nothing else: verl's plugin entry point makes the MessageQueue that a
    task runner in ``__main__`` creates trajbus's, in a fresh Ray cluster, and a worker importing verl
    afresh gets it too. The sample put is on the Kafka topic."""
    env = {**os.environ, "TRAJBUS_VERL_QUEUE": "kafka", "TRAJBUS_BOOTSTRAP_SERVERS": bootstrap_servers,
           "TRAJBUS_VERL_PREFIX": prefix, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "verl_layout_driver.py"), "run1"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["runner_queue"] == result["worker_import"] == "DurableMessageQueue"
    assert (result["put"], result["sample"], result["remaining"]) == (True, "one sample", 0)
    records = read_to_end(bootstrap_servers, f"{prefix}.verl.layout.run1")
    assert [record.value() for record in records] == [b"one sample"]
