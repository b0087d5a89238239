"""ROLL's env-manager protocol, with trajbus as the place rollouts go.

An ``EnvManager`` owns one environment and one agent. ``run_rollout_loop``
follows ROLL: ``group_seed = seed + group_id`` (``seed`` from the data's
``meta_info``); every episode asks the scheduler for its ``episode_id``, runs
with ``episode_seed = group_seed + episode_id``, and is submitted exactly once
when it finishes; the loop ends when ``reset()`` returns ``None`` (the
scheduler has no episode for it, or a traversal dataset is exhausted) or on
``stop()``.

The envs of one group get the same episode ids, hence the same seeds and the
same prompt: they are the rollouts of one GRPO group. In trajbus terms the
group's id ``f"{group_id}_{episode_id}_{episode_seed}"`` is the
``prompt_uid``, and each env's trajectory is ``f"{prompt_uid}_{env_id}"``.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trajbus.pipelines.agents import AgentStopped, BlackBoxAgent, Episode, WhiteBoxAgent
from trajbus.pipelines.envs import Observation

log = logging.getLogger(__name__)


class EpisodeScheduler:
    """Episode ids per group (ROLL's group queue, reduced): every env of a group walks 0, 1, 2, ..."""

    def __init__(self, episodes_per_group: int | None = None) -> None:
        self.episodes_per_group = episodes_per_group
        self._next: dict[tuple[int, int], int] = defaultdict(int)
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def get_episode_id(self, group_id: int, env_id: int) -> int | None:
        with self._lock:
            episode_id = self._next[(group_id, env_id)]
            if self._stopped.is_set() or (self.episodes_per_group is not None
                                           and episode_id >= self.episodes_per_group):
                return None
            self._next[(group_id, env_id)] = episode_id + 1
            return episode_id

    def stop(self) -> None:
        self._stopped.set()


@dataclass
class EnvConfig:
    group_id: int
    env_id: int
    group_size: int
    tag: str = "train"


class EnvManager:
    def __init__(self, env: Any, agent: BlackBoxAgent | WhiteBoxAgent, scheduler: EpisodeScheduler,
                 env_config: EnvConfig) -> None:
        self.env, self.agent, self.scheduler, self.env_config = env, agent, scheduler, env_config
        self.running = False
        self.group_seed = 0
        self.episode_id: int | None = None
        self.episodes: list[Episode] = []

    @property
    def episode_seed(self) -> int:
        return self.group_seed + (self.episode_id or 0)

    @property
    def prompt_uid(self) -> str:
        return f"{self.env_config.group_id}_{self.episode_id}_{self.episode_seed}"

    @property
    def trajectory_id(self) -> str:
        return f"{self.prompt_uid}_{self.env_config.env_id}"

    def reset(self) -> Observation | None:
        """The next episode's observation, or None when there is none for this env."""
        self.episode_id = self.scheduler.get_episode_id(self.env_config.group_id, self.env_config.env_id)
        if self.episode_id is None:
            return None
        return self.env.reset(seed=self.episode_seed)

    def run_rollout_loop(self, data: Any) -> int:
        """Roll out episodes until ``reset()`` returns None or ``stop()``; returns the episodes submitted."""
        meta_info = getattr(data, "meta_info", data)
        if "seed" not in meta_info:
            raise ValueError("meta_info: run_rollout_loop needs a 'seed'")
        self.running = True
        self.group_seed = meta_info["seed"] + self.env_config.group_id
        submitted = 0
        observation = self.reset()
        while self.running and observation is not None:
            metadata = {"tag": self.env_config.tag, "group_id": self.env_config.group_id,
                        "env_id": self.env_config.env_id, "episode_id": self.episode_id,
                        "episode_seed": self.episode_seed, "traj_id": self.trajectory_id}
            extra = {"trajectory_uid": self.trajectory_id} if isinstance(self.agent, WhiteBoxAgent) else {}
            try:
                episode = self.agent.run_episode(self.env, observation, prompt_uid=self.prompt_uid,
                                                 n_rollouts=self.env_config.group_size, metadata=metadata, **extra)
            except AgentStopped:  # stopped while paced: the episode never started
                break
            self.episodes.append(episode)
            submitted += 1
            observation = self.reset()
        self.running = False
        return submitted

    def stop(self) -> None:
        self.running = False
        self.agent.stop()


def validation_pass(managers: list[EnvManager], dataset_manager: Any, seed: int,
                    val_batch_size: int = -1) -> list[Episode]:
    """ROLL's validation: reset the datasets, then roll out; ``val_batch_size=-1`` traverses the whole set.

    Give every pass a fresh ``seed`` (e.g. the global step): prompt uids derive from it, and the
    stream worker treats a reused uid of a group already emitted as late.
    """
    if hasattr(dataset_manager.reset, "remote"):
        import ray

        ray.get(dataset_manager.reset.remote())
    else:
        dataset_manager.reset()
    per_env = None if val_batch_size == -1 else -(-val_batch_size // len(managers))
    scheduler = EpisodeScheduler(per_env)
    before = [len(m.episodes) for m in managers]
    for manager in managers:
        manager.scheduler = scheduler
    with ThreadPoolExecutor(len(managers)) as pool:
        for done in [pool.submit(m.run_rollout_loop, {"seed": seed}) for m in managers]:
            done.result()  # an agent's failure surfaces here
    return [e for m, n in zip(managers, before) for e in m.episodes[n:]]
