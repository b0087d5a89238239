"""verl V1's plug point in its real process layout.

``python tests/verl_v1_layout_driver.py ENGINE MODEL_DIR [OVERRIDE...]``.

A fresh local Ray cluster; verl's ``TaskRunnerV1`` runs as a Ray actor, as ``main_ppo`` runs it, and its own
``init_agent_loop_manager`` builds the agent-loop manager that the config's key names (the overrides: only
the key). The task runner's trainer is not built (it needs GPUs): in its place a stand-in answers the three
questions ``init_agent_loop_manager`` asks it, with verl's own ``LLMServerClient`` over verl's load balancer,
which lists one inference server (ENGINE). Then one step's prompts are registered in TransferQueue and
handed to the manager, as ``_submit_batch_to_rollout`` does. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray
from verl.trainer.main_ppo import TaskRunnerV1

from tests.verl_v1 import register, verl_batch, verl_config


class StandInTrainer:
    """What ``init_agent_loop_manager`` asks of verl's trainer: its LLM client, no teacher, no reward workers."""

    def __init__(self, config: Any, engine: str) -> None:
        from verl.workers.rollout.router import get_router_handle

        self.config = config
        self.balancer = get_router_handle(servers={engine: None})

    def get_llm_client(self) -> Any:
        from verl.workers.rollout.llm_server import LLMServerClient

        return LLMServerClient(self.config, load_balancer_handle=self.balancer)

    def get_teacher_client(self) -> None:
        return None

    def get_reward_handles(self) -> None:
        return None


@ray.remote(num_cpus=1)
class LayoutRunner(TaskRunnerV1.__ray_actor_class__):
    """verl's task runner; ``run_layout`` does what its ``run`` does up to the first dispatch."""

    def run_layout(self, config: Any, engine: str, timeout: float = 180.0) -> dict[str, Any]:
        import transfer_queue as tq

        config.transfer_queue.enable = True
        tq.init(config.transfer_queue)
        self.config = config
        self.trainer = StandInTrainer(config, engine)
        try:
            self.init_agent_loop_manager()  # verl's own: loads the class by the key, calls create()
            manager = self.agent_loop_manager
            batch = verl_batch([0, 1], step=1)
            uids = register(tq, batch, step=1)
            manager.generate_sequences(batch)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                tags = tq.kv_list("train")["train"]
                if all(tags.get(uid, {}).get("status") == "finished" for uid in uids):
                    break
                time.sleep(0.2)
            tags = tq.kv_list("train")["train"]
            return {"manager": f"{type(manager).__module__}.{type(manager).__name__}",
                    "gateway": manager.harness.gateway_url, "own_services": manager.services is not None,
                    "statuses": [tags.get(uid, {}).get("status") for uid in uids],
                    "keys": sorted(key for key in tags if not tags[key].get("is_prompt")),
                    "expected_keys": sorted(f"{uid}_{s}_0" for uid in uids
                                            for s in range(config.actor_rollout_ref.rollout.n))}
        finally:
            if self.agent_loop_manager is not None:
                self.agent_loop_manager.close()
            tq.close()


def main() -> None:
    from trajbus.infra import ray_exit

    engine, model_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    config = verl_config(model_dir, 2, 2, overrides)
    ray_exit.connect(num_cpus=6, include_dashboard=False, log_to_driver=False)
    result = ray.get(LayoutRunner.remote().run_layout.remote(config, engine))
    print(json.dumps(result), flush=True)
    ray.shutdown()
    ray_exit.exit_process(0)


if __name__ == "__main__":
    main()
