"""verl V1's sync training loop, as far as its data goes.

``python tests/verl_v1_crash_driver.py WORKDIR MODEL_DIR STOP_AT``.

Each step does what ``PPOTrainer.fit`` does with the data, with verl's own pieces: the dataloader
(``StatefulDataLoader``, ``create_rl_sampler``, ``collate_fn``) draws ``train_batch_size`` prompts, each gets
a fresh ``uuid4``, they are registered ``pending`` in TransferQueue and handed to the agent-loop manager
(trajbus's, by the key of verl's config), verl's ``ReplayBuffer`` samples the finished groups, the batch is
read with ``kv_batch_get`` and "trained" (its prompts' dataset indices appended, fsynced, to
``WORKDIR/trained.jsonl``), then cleared; every ``save_freq`` steps the checkpoint is what verl's holds of the
data: ``global_step_N/data.pt`` (the dataloader's state) and ``latest_checkpointed_iteration.txt``. A
resume starts from the newest checkpoint, as ``_load_checkpoint`` does.

At step ``STOP_AT`` (0: never) the agents of the step's second prompt wait (``tests.verl_v1.gated_agent``):
once the first prompt is ``finished`` in TransferQueue it prints ``READY <step>`` and waits to be killed, its
step neither sampled nor trained, one group ready and one cut. At the end it prints one JSON line of the
manager's counts.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import ray
import torch

from tests.verl_v1 import GATED, MANAGER, MANAGER_KEY, register, replay_buffer, verl_config

PROMPTS = 8


def dataset() -> list[dict]:
    return [{"raw_prompt": [{"role": "user", "content": f"What is 6 * 7? ({i})"}], "data_source": "calc",
             "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"index": i}, "index": i}
            for i in range(PROMPTS)]


def save(checkpoints: Path, step: int, dataloader: object) -> None:
    folder = checkpoints / f"global_step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(dataloader.state_dict(), folder / "data.pt")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text(str(step))


def trained(log: Path, step: int, indices: list[int]) -> None:
    with log.open("a") as out:
        out.write(json.dumps({"step": step, "indices": indices}) + "\n")
        out.flush()
        os.fsync(out.fileno())


def main() -> None:
    import transfer_queue as tq
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.utils import create_rl_sampler
    from verl.utils import tensordict_utils as tu
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.utils.import_utils import load_class_from_fqn

    from trajbus.infra import ray_exit

    workdir, model_dir, stop_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    checkpoints = workdir / "checkpoints"
    config = verl_config(model_dir, 2, 2, [f"{MANAGER_KEY}={MANAGER}", "trainer.experiment_name=crash",
                                           f"trainer.default_local_dir={checkpoints}", "data.seed=7",
                                           "trainer.save_freq=2"])
    items = dataset()
    dataloader = StatefulDataLoader(dataset=items, batch_size=2, drop_last=True, collate_fn=collate_fn,
                                    sampler=create_rl_sampler(config.data, items))
    latest = find_latest_ckpt_path(str(checkpoints))
    step = int(latest.split("global_step_")[-1]) if latest else 0
    if latest:
        dataloader.load_state_dict(torch.load(Path(latest) / "data.pt", weights_only=False))
    ray_exit.connect(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(config.transfer_queue)
    manager = load_class_from_fqn(config.actor_rollout_ref.rollout.agent.agent_loop_manager_class).create(
        config=config, llm_client=None, teacher_client=None, reward_loop_worker_handles=None)
    buffer = replay_buffer(config, 2)
    draws = iter(dataloader)
    for step in range(step + 1, PROMPTS // 2 + 1):
        batch_dict = next(draws)
        batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in batch_dict["raw_prompt"]], dtype=object)
        batch = tu.get_tensordict(batch_dict)
        tu.assign_non_tensor_data(batch, "global_steps", step)
        uids = register(tq, batch, step)
        if step == stop_at:
            GATED.add(int(batch_dict["index"][1]))
        manager.generate_sequences(batch)
        if step == stop_at:
            while tq.kv_list("train")["train"][uids[0]]["status"] != "finished":
                time.sleep(0.05)
            print(f"READY {step}", flush=True)
            time.sleep(3600)
        sampled, _ = buffer.sample(global_steps=step, partition_id="train", batch_size=2)
        data = tq.kv_batch_get(keys=sampled.keys, partition_id="train", select_fields=["index", "input_ids"])
        trained(workdir / "trained.jsonl", step, sorted({int(i) for i in data["index"]}))
        tq.kv_clear(keys=sampled.keys, partition_id="train")
        if step % int(config.trainer.save_freq) == 0:
            save(checkpoints, step, dataloader)
    print(json.dumps({"resumed": manager.resumed, "written": manager.feeders["train"].written}), flush=True)
    manager.close()
    tq.close()
    ray.shutdown()
    ray_exit.exit_process(0)


if __name__ == "__main__":
    main()
