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

Given a ``PromptLedger`` (``pipelines.ledger``), the ``EpisodeScheduler`` records each
group's episode on Kafka, acknowledged, before any env of the group starts it, and a
scheduler built on that ledger after a crash resumes: each group continues after its
last dispatched episode, and the episodes left open are abandoned (those the worker
already emitted are trained from the groups topic) and rolled out again exactly once,
first, with the same seed (the same prompt) under ``f"{prompt_uid}~{attempt}"``.
Without a ledger nothing changes.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trajbus.pipelines.agents import AgentStopped, BlackBoxAgent, Episode, WhiteBoxAgent
from trajbus.pipelines.envs import Observation
from trajbus.streams.wire.ledger import Dispatch, attempt_of, with_attempt

if TYPE_CHECKING:
    from trajbus.pipelines.ledger import PromptLedger

log = logging.getLogger(__name__)


def roll_prompt_uid(group_id: int, episode_id: int, episode_seed: int, attempt: int = 0) -> str:
    """ROLL's group id ``{group_id}_{episode_id}_{episode_seed}``; a re-issue after a resume adds ``~{attempt}``."""
    return with_attempt(f"{group_id}_{episode_id}_{episode_seed}", attempt)


def parse_prompt_uid(prompt_uid: str) -> tuple[int, int, int, int] | None:
    """(group_id, episode_id, episode_seed, attempt) of a ROLL prompt uid; None for any other uid."""
    try:
        base, attempt = attempt_of(prompt_uid)
        group_id, episode_id, episode_seed = (int(part) for part in base.split("_"))
        return group_id, episode_id, episode_seed, attempt
    except ValueError:
        return None


@dataclass(frozen=True)
class EpisodeTicket:
    """An episode handed to one env. A re-issue carries its attempt, the seed its first dispatch rolled out
    with (same seed, same prompt) and the uid it re-issues."""

    episode_id: int
    attempt: int = 0
    seed: int | None = None
    origin: str | None = None


DEFAULT_DATASET = "roll-episodes/0"
"""The dataset a scheduler's dispatches name when it is given none (``GlobalDataset.identity()`` is better)."""


class EpisodeScheduler:
    """Episode ids per group (ROLL's group queue, reduced): every env of a group walks 0, 1, 2, ...

    On a ``ledger``, the first env of a group to reach an episode records the group's dispatch,
    acknowledged, before it gets the id; the other envs get the same id without another record.
    Built on a ledger that already holds records, it resumes: open dispatches are abandoned
    (``settle_open``), every env of a group first walks its abandoned episodes again (same seed,
    uid ``...~attempt``, whatever ``episodes_per_group`` says: they were promised), then the
    group's episodes after the last one dispatched.
    """

    def __init__(self, episodes_per_group: int | None = None, ledger: PromptLedger | None = None,
                 dataset: str | Any | None = None) -> None:
        self.episodes_per_group = episodes_per_group
        self.ledger = ledger
        self.dataset_id = _dataset_identity(dataset) if ledger is not None else DEFAULT_DATASET
        self._next: dict[tuple[int, int], int] = defaultdict(int)
        """(group, env) -> the env's position in its group's sequence (its episode id without a resume)."""
        self._start: dict[int, int] = defaultdict(int)
        """group -> its first fresh episode id (after the last one the ledger holds)."""
        self._again: dict[int, list[Dispatch]] = {}
        """group -> the dispatches abandoned at the resume, walked first."""
        self._recorded: dict[int, int] = defaultdict(int)
        """group -> how many positions of its sequence are on the ledger."""
        self._group_locks: dict[int, threading.Lock] = defaultdict(threading.Lock)
        self._write_lock = threading.Lock()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        if ledger is not None:
            self._resume(ledger)

    def _resume(self, ledger: PromptLedger) -> None:
        """Each group's counter after its last dispatched episode; its abandoned episodes due again."""
        ledger.provision()
        ledger.refresh()
        ledger.view.check_dataset(self.dataset_id)
        due = ledger.settle_open(why="episode scheduler resumed")
        for dispatch in ledger.view.dispatched.values():
            if (parsed := parse_prompt_uid(dispatch.prompt_uid)) is not None:
                self._start[parsed[0]] = max(self._start[parsed[0]], parsed[1] + 1)
        for dispatch in due:
            if (parsed := parse_prompt_uid(dispatch.prompt_uid)) is not None:
                self._again.setdefault(parsed[0], []).append(dispatch)
        for again in self._again.values():  # in episode order, as the group walked them
            again.sort(key=lambda dispatch: parse_prompt_uid(dispatch.prompt_uid)[1])  # type: ignore[index]

    def get_episode_id(self, group_id: int, env_id: int, group_seed: int | None = None,
                       group_size: int = 1) -> int | None:
        """The env's next episode id, or None. On a ledger, ``group_seed`` names the prompt it records."""
        ticket = self.next_episode(group_id, env_id, group_seed, group_size)
        return None if ticket is None else ticket.episode_id

    def next_episode(self, group_id: int, env_id: int, group_seed: int | None = None,
                     group_size: int = 1) -> EpisodeTicket | None:
        """The env's next episode (a re-issue first), recorded on the ledger by the group's first env."""
        with self._lock:
            group_lock = self._group_locks[group_id]
        with group_lock:  # the other envs of the group wait until the dispatch is acknowledged
            position = self._next[(group_id, env_id)]
            ticket = self._ticket(group_id, position)
            if ticket is None:
                return None
            if self.ledger is not None and position >= self._recorded[group_id]:
                with self._write_lock:  # one acknowledged write at a time: the ledger's view is not thread-safe
                    self.ledger.write([self._dispatch(group_id, ticket, group_seed, group_size)])
                self._recorded[group_id] = position + 1
            self._next[(group_id, env_id)] = position + 1
            return ticket

    def _ticket(self, group_id: int, position: int) -> EpisodeTicket | None:
        if self._stopped.is_set():
            return None
        again = self._again.get(group_id, [])
        if position < len(again):
            _, episode_id, seed, attempt = parse_prompt_uid(again[position].prompt_uid)  # type: ignore[misc]
            return EpisodeTicket(episode_id, attempt + 1, seed, again[position].prompt_uid)
        episode_id = self._start[group_id] + position - len(again)
        if self.episodes_per_group is not None and episode_id >= self.episodes_per_group:
            return None
        return EpisodeTicket(episode_id)

    def _dispatch(self, group_id: int, ticket: EpisodeTicket, group_seed: int | None, group_size: int) -> Dispatch:
        """The record of a group's episode: a first dispatch, or the re-issue of an abandoned one."""
        ledger = self.ledger
        if ticket.origin is not None:
            root = ledger.view.root(ticket.origin)
            uid = roll_prompt_uid(group_id, ticket.episode_id, ticket.seed, ticket.attempt)
            return Dispatch(uid, ledger.channel, group_size, self.dataset_id, root.epoch, root.offset,
                            list(root.sample_indices), ledger.policy_version(), "reissue", ticket.origin)
        if group_seed is None:
            raise ValueError("group_seed: a scheduler on a ledger names each prompt by its seed")
        uid = roll_prompt_uid(group_id, ticket.episode_id, group_seed + ticket.episode_id)
        return Dispatch(uid, ledger.channel, group_size, self.dataset_id, 0, ticket.episode_id, [ticket.episode_id],
                        ledger.policy_version())

    def stop(self) -> None:
        self._stopped.set()


def _dataset_identity(dataset: str | Any | None) -> str:
    """What the ledger names the episodes' dataset by: a string, or a (local or actor) GlobalDataset's identity.
    A traversal dataset is refused: its items do not follow the seed, so a re-issue would get another one."""
    if dataset is None or isinstance(dataset, str):
        return dataset or DEFAULT_DATASET
    if getattr(dataset, "mode", "sample") == "traversal":
        raise ValueError("dataset: a traversal GlobalDataset hands out the next item whatever the seed, so an "
                         "episode re-issued after a resume would get another prompt; use sample mode on a ledger")
    if hasattr(dataset.identity, "remote"):
        import ray

        return ray.get(dataset.identity.remote())
    return dataset.identity()


@dataclass
class EnvConfig:
    group_id: int
    env_id: int
    group_size: int
    tag: str = "train"


class EnvManager:
    def __init__(self, env: Any, agent: BlackBoxAgent | WhiteBoxAgent, scheduler: EpisodeScheduler,
                 env_config: EnvConfig) -> None:
        ledger = getattr(scheduler, "ledger", None)
        if ledger is not None and getattr(agent, "channel", ledger.channel) != ledger.channel:
            raise ValueError(f"scheduler: its ledger is of channel {ledger.channel!r}, the agent writes to "
                             f"{agent.channel!r} (the worker that settles its prompts reads the agent's)")
        self.env, self.agent, self.scheduler, self.env_config = env, agent, scheduler, env_config
        self.running = False
        self.group_seed = 0
        self.episode_id: int | None = None
        self.attempt = 0
        """0, or the attempt of an episode re-issued after a resume (its uid ends in ``~attempt``)."""
        self.reissued_seed: int | None = None
        """A re-issue's seed, as its first dispatch had it: the same prompt again."""
        self.episodes: list[Episode] = []

    @property
    def episode_seed(self) -> int:
        if self.reissued_seed is not None:
            return self.reissued_seed
        return self.group_seed + (self.episode_id or 0)

    @property
    def prompt_uid(self) -> str:
        return roll_prompt_uid(self.env_config.group_id, self.episode_id, self.episode_seed, self.attempt)

    @property
    def trajectory_id(self) -> str:
        return f"{self.prompt_uid}_{self.env_config.env_id}"

    def reset(self) -> Observation | None:
        """The next episode's observation, or None when there is none for this env."""
        ticket = self.scheduler.next_episode(self.env_config.group_id, self.env_config.env_id,
                                             group_seed=self.group_seed, group_size=self.env_config.group_size)
        self.episode_id = None if ticket is None else ticket.episode_id
        self.attempt, self.reissued_seed = (0, None) if ticket is None else (ticket.attempt, ticket.seed)
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
            if self.attempt:
                metadata["attempt"] = self.attempt
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
