"""The two processes of the verl queue's crash test: ``python -m tests.verl_crash_driver ROLE ...``, each
built on trajbus's ``DurableMessageQueue`` as verl's fully-async rollouter and trainer use it.

``rollouter --first I --count N [--seconds S] [--end]``: generates for ``S`` seconds, then puts real-size samples (a pickled ``RolloutSample`` of a
``DataProto`` of 8 responses of 2048 + 512 tokens) ``I .. I+N-1``, each printed ``put <i>`` once
acknowledged; ``--end`` then puts verl's end-of-stream ``None``.

``trainer --checkpoint-dir D``: verl's ``FullyAsyncTrainer`` loop in small: a step takes
``ppo_mini_batch_size * require_batches`` samples with ``get_sample`` (each printed ``got <i> <k>``,
``k`` its place in the step); every ``trigger_parameter_sync_step`` steps the policy version moves on and a
checkpoint is saved as verl saves it (``global_step_<v>/``, holding here the sample ids trained since the
previous one, then ``latest_checkpointed_iteration.txt``), printed ``checkpoint <v>``. A restart resumes
from the latest checkpoint, as verl's does. Ends at the sentinel, printing ``done``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

MINI_BATCH, REQUIRE_BATCHES, SYNC_STEPS = 2, 2, 1


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def config(checkpoint_dir: str, experiment: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "trainer": {"project_name": "crash", "experiment_name": experiment, "resume_mode": "auto",
                    "default_local_dir": checkpoint_dir},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": MINI_BATCH}},
        "async_training": {"require_batches": REQUIRE_BATCHES, "trigger_parameter_sync_step": SYNC_STEPS}})


def sample(i: int) -> bytes:
    """A real-size sample (the benchmark's), its id in ``sample_id``."""
    import torch

    from benchmarks.verl_queue_bench import make_sample

    return make_sample(i, torch.Generator().manual_seed(i))


def sample_id(data: bytes) -> int:
    import ray

    return int(ray.cloudpickle.loads(data).sample_id.removeprefix("sample_"))


async def rollouter(queue: Any, first: int, count: int, seconds: float, end: bool) -> None:
    for i in range(first, first + count):
        await asyncio.sleep(seconds)  # generation: the trainer waits for samples, as it does on real rollouts
        assert await queue.put_sample(sample(i)) is True
        say(f"put {i}")
    if end:
        await queue.put_sample(None)
        say("end")


async def trainer(queue: Any, checkpoint_dir: Path) -> None:
    from trajbus.consumers.verl.checkpoints import resume_version

    version, step, trained = resume_version(queue.config) or 0, 0, []
    required = MINI_BATCH * REQUIRE_BATCHES
    while True:
        batch = []
        while len(batch) < required:
            data, _remaining = await queue.get_sample()
            if data is None:
                say("done")
                return
            batch.append(sample_id(data))
            say(f"got {batch[-1]} {len(batch)}")
        trained.extend(batch)
        step += 1
        if step % SYNC_STEPS == 0:
            version += 1
            folder = checkpoint_dir / f"global_step_{version}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "trained.json").write_text(json.dumps(trained))
            (checkpoint_dir / "latest_checkpointed_iteration.txt").write_text(str(version))
            trained = []
            say(f"checkpoint {version}")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("rollouter", "trainer"))
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--end", action="store_true")
    args = parser.parse_args()
    from trajbus.consumers.verl.queue import DurableMessageQueue

    queue = DurableMessageQueue(config(args.checkpoint_dir, args.experiment), max_queue_size=8)
    try:
        if args.role == "rollouter":
            await rollouter(queue, args.first, args.count, args.seconds, args.end)
        else:
            await trainer(queue, Path(args.checkpoint_dir))
    finally:
        queue.close()


if __name__ == "__main__":
    asyncio.run(main())
