"""verl's fully-async process layout in small: run as ``python tests/verl_layout_driver.py TOPIC`` with verl's
stock environment plus ``TRAJBUS_VERL_QUEUE``. Like ``fully_async_main``, a task-runner actor defined in
``__main__`` creates ``MessageQueue.remote(config, max_queue_size)`` from the name it imported from verl's
``message_queue`` module, and a Ray worker that imports ``fully_async_main`` afresh says which queue it
gets. Prints one JSON line."""

from __future__ import annotations

import asyncio
import json
import sys

import ray
from omegaconf import OmegaConf

from verl.experimental.fully_async_policy.message_queue import MessageQueue, MessageQueueClient


@ray.remote(num_cpus=1)
class TaskRunner:
    """The part of ``FullyAsyncTaskRunner._initialize_components`` that makes the queue, then one put and get."""

    def run(self, config) -> dict:
        queue = MessageQueue.remote(config, 4)
        client = MessageQueueClient(queue)
        put = asyncio.run(client.put_sample(b"one sample"))
        sample, remaining = client.get_sample_sync()
        return {"runner_queue": MessageQueue.__ray_metadata__.class_name, "put": put, "sample": sample.decode(), "remaining": remaining,
                "statistics": client.get_statistics_sync()}


@ray.remote(num_cpus=1)
def fresh_import() -> str:
    """What a Ray worker that imports verl's fully-async main module afresh gets as ``MessageQueue``."""
    from verl.experimental.fully_async_policy import fully_async_main

    return fully_async_main.MessageQueue.__ray_metadata__.class_name


def main() -> None:
    from trajbus.infra import ray_exit

    config = OmegaConf.create({
        "trainer": {"project_name": "layout", "experiment_name": sys.argv[1], "resume_mode": "disable",
                    "default_local_dir": "/nonexistent"},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 1}},
        "async_training": {"require_batches": 1, "trigger_parameter_sync_step": 1}})
    ray_exit.connect(num_cpus=4, include_dashboard=False, log_to_driver=False)
    result = ray.get(TaskRunner.remote().run.remote(config))
    result["worker_import"] = ray.get(fresh_import.remote())
    print(json.dumps(result), flush=True)
    ray.shutdown()
    ray_exit.exit_process(0)


if __name__ == "__main__":
    main()
