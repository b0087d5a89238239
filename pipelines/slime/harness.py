"""slime's samples run by agents through trajbus's gateway: one trajectory per sample, one group per prompt.

For each sample of a group handed out, the harness opens a trajectory (``POST /init_trajectory`` with
the group's ``prompt_uid``, ``n_rollouts`` = the group's size, the channel, and the sample's ``index``
in its metadata, so the assembled group says which trajectory answered which sample), runs the agent
(``pipelines.slime.agents``) on its ``base_url`` and completes the trajectory with the agent's reward
(None: the gateway's ``--reward-function`` scores it; the sample's label is in the metadata as ``answer``).
The gateway records every call token-exactly and the stream worker assembles the group: the harness
writes nothing to Kafka itself. Agents run in a pool of ``concurrency`` threads, in dispatch order; a
gateway that paces generation is waited out as ``pipelines.agents.GatewayAgent`` does (``?wait=``, then
``Retry-After``).
"""

from __future__ import annotations

import copy
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trajbus.pipelines.agents import ADMISSION_WAIT, GatewayAgent
from trajbus.pipelines.slime.agents import Agent

__all__ = ["AgentHarness", "GroupRun", "SAMPLE_INDEX"]

log = logging.getLogger("trajbus.slime")

SAMPLE_INDEX = "slime_index"
"""Trajectory metadata key (on every step): the ``index`` of the sample the trajectory answers."""
ANSWER = "answer"
"""Trajectory metadata key: the sample's label, as ``gateway.rewards.answer_match`` reads it."""


@dataclass
class GroupRun:
    """One group's agents: the samples as handed out, and one future per sample (its reward)."""

    prompt_uid: str
    samples: list[Any]
    """Copies of the samples as handed out (the agents get their own): what goes back to the buffer."""
    futures: list[Future] = field(default_factory=list)

    def done(self) -> bool:
        return all(future.done() for future in self.futures)

    def failure(self) -> str | None:
        """Why an agent of this finished group failed (the first one), or None."""
        for future in self.futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                exc = future.exception()
                return f"{type(exc).__name__}: {exc}"
        return None


class AgentHarness(GatewayAgent):
    """Runs ``agent`` for each sample of a group, through the gateway at ``gateway_url``."""

    def __init__(self, gateway_url: str, agent: Agent, concurrency: int, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        super().__init__(gateway_url, api_key=api_key, timeout=timeout)
        self.agent = agent
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="trajbus-agent")

    def start(self, prompt_uid: str, group: list[Any], channel: str, sampling: dict[str, Any]) -> GroupRun:
        """Queue the group's agents; the run's futures end with each trajectory completed."""
        run = GroupRun(prompt_uid, copy.deepcopy(group))
        for sample in group:
            run.futures.append(self.pool.submit(self._trajectory, prompt_uid, len(group), sample, channel,
                                                dict(sampling)))
        return run

    def _trajectory(self, prompt_uid: str, n_rollouts: int, sample: Any, channel: str,
                    sampling: dict[str, Any]) -> float | None:
        metadata = {SAMPLE_INDEX: sample.index}
        if sample.label is not None:  # what the gateway's answer_match reward function compares with
            metadata[ANSWER] = sample.label
        opened = self._post(f"{self.gateway_url}/init_trajectory", params={"wait": ADMISSION_WAIT},
                            json={"prompt_uid": prompt_uid, "n_rollouts": n_rollouts, "channel": channel,
                                  "metadata": metadata})
        reward = self.agent(opened["base_url"], copy.deepcopy(sample), sampling)
        done = self._post(f"{opened['base_url']}/complete_trajectory",
                          json={} if reward is None else {"reward": float(reward)})
        return done.get("reward")

    def close(self) -> None:
        """Stop waiting for admission, cancel the agents not started, and wait for those running to end."""
        self.stop()
        self.pool.shutdown(wait=True, cancel_futures=True)
        super().close()
