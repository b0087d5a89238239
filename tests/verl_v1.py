"""verl V1's own pieces, as its trainer uses them, for the tests of trajbus's agent-loop manager.

The config is verl's ``ppo_trainer`` (hydra, from the installed package) with small sizes; a batch is built
from the dataloader's columns with verl's ``tu.get_tensordict`` and registered in TransferQueue as
``PPOTrainer._submit_batch_to_rollout`` registers it; the replay buffer is verl's ``ReplayBuffer`` built
as ``PPOTrainer._build_replay_buffer`` builds it for the sync trainer.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np

MANAGER = "trajbus.VerlAgentLoopManager"
MANAGER_KEY = "+actor_rollout_ref.rollout.agent.agent_loop_manager_class"


def verl_config(model_dir: Path | str, n: int, batch: int, extra: list[str] = ()) -> Any:
    """verl's default trainer config, sized for the tiny model and this machine: TransferQueue's controller
    and each of its storage units hold a Ray CPU (verl's 8 units would wait forever for 9 CPUs)."""
    import verl.trainer.config as configs
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.dirname(configs.__file__), version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.rollout.n={n}",
            f"data.train_batch_size={batch}", "data.max_prompt_length=512", "data.max_response_length=256",
            "actor_rollout_ref.rollout.val_kwargs.n=2", "trainer.project_name=trajbus-tests",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=2", *extra])


def verl_batch(indices: list[int], step: int, uids: list[str] | None = None) -> Any:
    """A batch as V1's ``_next_train_batch`` hands it to the agent-loop manager: the dataloader's columns,
    a fresh uuid4 per prompt, ``global_steps`` as non-tensor data."""
    from verl.utils import tensordict_utils as tu

    def column(values: list[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    columns = {
        "raw_prompt": column([[{"role": "user", "content": f"What is 6 * 7? ({i})"}] for i in indices]),
        "data_source": column(["calc"] * len(indices)),
        "reward_model": column([{"style": "rule", "ground_truth": "42"} for _ in indices]),
        "extra_info": column([{"index": i} for i in indices]),
        "index": column(list(indices)),
        "uid": column(uids or [str(uuid.uuid4()) for _ in indices]),
    }
    batch = tu.get_tensordict(columns)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    return batch


def register(tq: Any, batch: Any, step: int, partition: str = "train") -> list[str]:
    """The prompts ``pending`` in TransferQueue (the sync trainer's registration); their uids."""
    uids = [str(uid) for uid in batch["uid"]]
    tq.kv_batch_put(keys=uids, partition_id=partition,
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids])
    return uids


def replay_buffer(config: Any, batch_size: int) -> Any:
    """verl's ReplayBuffer of the sync trainer, as ``PPOTrainer._build_replay_buffer`` builds it."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    sampler, mode = config.trainer.v1.sampler, config.trainer.v1.trainer_mode
    return ReplayBuffer(trainer_mode=mode, trainer_config=config.trainer.v1.get(mode, {}),
                        max_off_policy_threshold=sampler.max_off_policy_threshold,
                        max_off_policy_strategy=sampler.max_off_policy_strategy,
                        sampler_kwargs=sampler.sampler_kwargs, refill_fn=None, filter_groups_metric=None,
                        sync_refill_failed_groups=False, train_batch_size=batch_size, gen_batch_size=batch_size,
                        max_inflight_gen_batches=1, poll_interval=0.05)


def failing_agent(base_url: str, sample: Any, sampling: dict[str, Any]) -> float:
    """An agent whose environment breaks before its first call."""
    raise RuntimeError(f"the environment of session {sample.index} is gone")


GATED: set[int] = set()
"""Dataset indices whose agents wait (the crash driver fills it in its own process, where the agents run)."""
_never = threading.Event()


def gated_agent(base_url: str, sample: Any, sampling: dict[str, Any]) -> float | None:
    """The calculator agent, except for a prompt in ``GATED``: its agents wait, trajectories opened, until the
    process is killed (a group provably cut by the kill)."""
    from trajbus.pipelines.slime.agents import calculator_agent

    if int(sample.fields["index"]) in GATED:
        _never.wait()
    return calculator_agent(base_url, sample, sampling)
