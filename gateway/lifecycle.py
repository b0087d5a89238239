"""A black-box trajectory's life: initialized (admitted), registered, called, completed.

The state lives in ``gateway.trajectories`` (SQLite under ``--state-dir``), so a
restarted instance continues its trajectories; this part holds the rules: who
may call, what a completion publishes, and that one trajectory's calls publish
one at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import weakref
from typing import Any

from trajbus.gateway.errors import GatewayError, bad_request, conflict, from_value_error, not_found
from trajbus.gateway.kafka_link import END_NOT_ACKNOWLEDGED, KafkaLink, kafka_failure
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.pacing import Pacing
from trajbus.gateway.rewards import RewardScorer
from trajbus.gateway.trajectories import COMPLETED, COMPLETING, OPEN, Trajectory, TrajectoryStore
from trajbus.gateway.updates import UpdateGate
from trajbus.streams.producer import DeliveryError, TopicsUnavailable
from trajbus.streams.records import validate_metadata

log = logging.getLogger("trajbus.gateway")


PROMPT_UID_REQUIRED = ("prompt_uid: required: the id of the prompt this rollout answers. The rollouts of one prompt "
                       "share it: the worker groups them by it (GRPO compares their rewards), so a trajectory without "
                       "it would be a group of its own that never fills")


def missing_prompt_uid() -> GatewayError:
    """400 for a trajectory started without its prompt's id (``init_trajectory``, a white-box admission)."""
    return bad_request(PROMPT_UID_REQUIRED, param="prompt_uid", code="missing_prompt_uid")


def checked_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """Metadata that can go on the wire (``validate_metadata``, the Python API's rule: UTF-8 JSON, so no
    lone surrogate), else 400 naming the problem."""
    try:
        validate_metadata(metadata or {})
    except ValueError as exc:
        raise from_value_error(exc) from None
    return metadata or {}


def reward_input(trajectory: Trajectory) -> dict[str, Any]:
    """What the reward function receives for a trajectory completed without a reward."""
    conversation = trajectory.last_conversation or []
    last = conversation[-1] if conversation and conversation[-1].get("role") == "assistant" else {}
    return {"trajectory_uid": trajectory.trajectory_uid, "prompt_uid": trajectory.prompt_uid,
            "channel": trajectory.channel, "metadata": trajectory.metadata, "messages": conversation,
            "response_text": last.get("content") or ""}


class TrajectoryLifecycle:
    """The rules of a trajectory's life, over its stored state."""

    def __init__(self, default_channel: str, store: TrajectoryStore, kafka: KafkaLink, pacing: Pacing,
                 rewards: RewardScorer, metrics: GatewayMetrics, updates: UpdateGate | None = None) -> None:
        self.default_channel, self.store, self.kafka, self.pacing = default_channel, store, kafka, pacing
        self.rewards, self.metrics, self.updates = rewards, metrics, updates
        self._publishing: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    async def channel(self, channel: str | None) -> str:
        """The channel a call names (None: the default), if a worker can serve it; else 400 (see
        ``gateway.channels``)."""
        return await self.kafka.channels.check(channel)

    def publishing(self, trajectory_uid: str) -> asyncio.Lock:
        """One trajectory's calls publish one at a time (each sees the context the previous one left)."""
        lock = self._publishing.get(trajectory_uid)
        if lock is None:
            lock = self._publishing[trajectory_uid] = asyncio.Lock()
        return lock

    def serving(self, channel: str | None = None) -> int:
        """The version the engines serve: the newer of Kafka's and the last resume's (a resume may come
        before the gateway reads the version from Kafka); 0 when neither is known."""
        known = [v for v in (self.kafka.serving(channel or self.default_channel),
                             self.updates.version if self.updates is not None else None) if v is not None]
        return max(known) if known else 0

    def policy_version(self, trajectory: Trajectory) -> int:
        """What its steps are stamped with: the version it declared, else the one the engines serve."""
        return trajectory.policy_version if trajectory.policy_version is not None else self.serving(trajectory.channel)

    async def init(self, prompt_uid: str | None, channel: str | None, n_rollouts: int | None,
                   metadata: dict[str, Any] | None, policy_version: int | None, wait: float = 0.0) -> Trajectory:
        if not prompt_uid:
            raise missing_prompt_uid()
        trajectory = Trajectory(trajectory_uid=secrets.token_urlsafe(18),  # 144 random bits: unguessable
                                prompt_uid=prompt_uid, channel=await self.channel(channel), n_rollouts=n_rollouts,
                                metadata=checked_metadata(metadata), policy_version=policy_version)
        await self.pacing.admit(trajectory.trajectory_uid, trajectory.channel, trajectory.prompt_uid,
                                policy_version, wait)
        await self.store.write(self.store.create, trajectory)
        self.metrics.trajectories.labels("initialized").inc()
        log.info("trajectory initialized trajectory=%s prompt=%s channel=%s", trajectory.trajectory_uid,
                 trajectory.prompt_uid, trajectory.channel)
        return trajectory

    def get(self, trajectory_uid: str, prompt_uid: str, open_only: bool = True) -> Trajectory:
        """The trajectory of a base_url: 404 if unknown, 409 if completed (when ``open_only``)."""
        trajectory = self.store.get(trajectory_uid)
        if trajectory is None or trajectory.prompt_uid != prompt_uid:
            raise not_found(f"unknown trajectory {trajectory_uid!r}: call POST /init_trajectory for a base_url")
        if open_only and trajectory.status != OPEN:
            raise conflict(f"trajectory {trajectory_uid} is {trajectory.status}")
        return trajectory

    async def register(self, trajectory: Trajectory, channel: str | None, n_rollouts: int | None,
                 metadata: dict[str, Any] | None, policy_version: int | None) -> Trajectory:
        changes: dict[str, Any] = {}
        if channel is not None and channel != trajectory.channel:
            if trajectory.next_step:
                raise conflict("channel cannot change after the trajectory's first call")
            changes["channel"] = await self.channel(channel)
        if n_rollouts is not None:
            changes["n_rollouts"] = n_rollouts
        if metadata:
            changes["metadata"] = checked_metadata({**trajectory.metadata, **metadata})
        if policy_version is not None:
            changes["policy_version"] = policy_version
        if changes:
            await self.store.write(self.store.update, trajectory.trajectory_uid, **changes)
        return dataclasses.replace(trajectory, **changes)

    async def complete(self, trajectory: Trajectory, reward: float | None,
                       metadata: dict[str, Any] | None) -> tuple[float, Trajectory]:
        """Score (when no reward is given) and publish the trajectory's end naming its acknowledged
        steps (``END_STEPS``; none when unknown, and the worker's 0..last rule applies); 409 the second
        time. Returns the reward and the trajectory as it was completed."""
        uid = trajectory.trajectory_uid
        if trajectory.status == COMPLETED:
            raise conflict(f"trajectory {uid} is already completed")
        if not trajectory.published_steps:
            raise bad_request(f"trajectory {uid} has no steps to complete", code="empty_trajectory")
        if reward is None:
            reward = await self.rewards.answer(reward_input(trajectory))
        self.kafka.require()
        metadata = checked_metadata(metadata)
        async with self.publishing(uid):  # calls in flight have published or failed: the list is final
            closed = await self.store.write(self.store.transition, uid, OPEN, COMPLETING)  # no more calls now
            current = self.store.get(uid)
            if not closed and current.status != COMPLETING:  # completing: an earlier end may land
                raise conflict(f"trajectory {uid} is already {current.status}")
            try:
                await self.kafka.end_trajectory(uid, trajectory.prompt_uid, reward, trajectory.channel,
                                                trajectory.n_rollouts, metadata, current.acknowledged)
            except TopicsUnavailable as exc:  # nothing was sent: the trajectory may go on
                await self.store.write(self.store.transition, uid, COMPLETING, OPEN)
                raise kafka_failure(exc, END_NOT_ACKNOWLEDGED) from None
            except DeliveryError as exc:  # the end may still land: only a retry of the same end is accepted
                raise kafka_failure(exc, END_NOT_ACKNOWLEDGED) from None
            await self.store.write(self.store.transition, uid, COMPLETING, COMPLETED)
        self.pacing.release(uid)
        self.metrics.trajectories.labels("completed").inc()
        self.metrics.reward.labels(str(self.policy_version(trajectory))).observe(reward)
        log.info("trajectory completed trajectory=%s prompt=%s steps=%d reward=%s", uid, trajectory.prompt_uid,
                 current.published_steps, reward)
        return reward, current
