"""A trajectory's life: initialized (admitted), registered, called, completed.

The state lives in ``gateway.state.trajectories`` (SQLite under ``--state-dir``), so a
restarted instance continues its trajectories; this part holds the rules: who
may call, what a call and a completion publish, and that one trajectory's calls
publish one at a time. A white-box trajectory (``/generate``, ``/submit_steps``)
is admitted at its first generation and leaves pacing with its last step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import weakref
from array import array
from typing import Any, Protocol, Sequence

from trajbus.gateway.admission.pacing import Pacing
from trajbus.gateway.broker.kafka_link import END_NOT_ACKNOWLEDGED, KafkaLink, kafka_failure
from trajbus.gateway.errors import GatewayError, bad_request, conflict, from_value_error, not_found
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.prompts.conversation import Prompt
from trajbus.gateway.prompts.token_ids import joined, sampled_ids
from trajbus.gateway.rewards import RewardScorer
from trajbus.gateway.state.served_version import ServedVersion
from trajbus.gateway.state.trajectories import COMPLETED, COMPLETING, OPEN, Trajectory, TrajectoryStore
from trajbus.streams.client.producer import DeliveryError, TopicsUnavailable
from trajbus.streams.wire.records import CONTINUES, SEGMENT_START, Step, validate_metadata
from trajbus.streams.wire.versions import Segments

log = logging.getLogger("trajbus.gateway")


PROMPT_UID_REQUIRED = ("prompt_uid: required: the id of the prompt this rollout answers. The rollouts of one prompt "
                       "share it: the worker groups them by it (GRPO compares their rewards), so a trajectory without "
                       "it would be a group of its own that never fills")


GET_A_BASE_URL = ('POST /init_trajectory {"prompt_uid": ...} and use the base_url it returns as the client\'s '
                  "base_url")
"""How an agent gets the URL it calls the engine under: what a call without a known trajectory is told."""


def missing_trajectory(path: str, api: str) -> GatewayError:
    """400 for an engine call at the gateway's root (a client pointed at it as at vLLM or Anthropic's API):
    the call names no trajectory, so the answer says how to get the base_url that does."""
    return bad_request(f"POST {path} names no trajectory: this gateway serves {api} per trajectory: "
                       f"{GET_A_BASE_URL}", code="missing_trajectory")


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


class SampledChoice(Protocol):
    """One choice of an engine call, as publication reads it (``gateway.engine.generation.Sampled``)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    segments: Segments


def lineage(previous: int | None, first_step: int, choice: int, new_segment: bool) -> dict[str, Any]:
    """Where a call's step stands in its trajectory's token sequence (``SEGMENT_START`` / ``CONTINUES``):
    ``previous``, the step whose tokens the prompt continued (None: the first call)."""
    if choice > 0 or (previous is not None and new_segment):
        return {SEGMENT_START: True}
    if previous is not None and previous != first_step - 1:
        return {CONTINUES: previous}
    return {}


def new_trajectory_uid() -> str:
    """144 random bits (unguessable), URL-safe, never beginning with ``-``: a command line reads such an argument
    as an option (``trajbus trace UID`` refused one uid in 64)."""
    while (uid := secrets.token_urlsafe(18)).startswith("-"):
        pass
    return uid


class TrajectoryLifecycle:
    """The rules of a trajectory's life, over its stored state."""

    def __init__(self, default_channel: str, store: TrajectoryStore, kafka: KafkaLink, pacing: Pacing,
                 rewards: RewardScorer, metrics: GatewayMetrics, served: ServedVersion) -> None:
        self.default_channel, self.store, self.kafka, self.pacing = default_channel, store, kafka, pacing
        self.rewards, self.metrics, self.served = rewards, metrics, served
        self._publishing: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    async def channel(self, channel: str | None) -> str:
        """The channel a call names (None: the default), if a worker can serve it; else 400 (see
        ``gateway.broker.channels``)."""
        return await self.kafka.channels.check(channel)

    def publishing(self, trajectory_uid: str) -> asyncio.Lock:
        """One trajectory's calls publish one at a time (each sees the context the previous one left)."""
        lock = self._publishing.get(trajectory_uid)
        if lock is None:
            lock = self._publishing[trajectory_uid] = asyncio.Lock()
        return lock

    def policy_version(self, trajectory: Trajectory) -> int:
        """What its steps are stamped with: the version it declared, else the one the engines serve."""
        if trajectory.policy_version is not None:
            return trajectory.policy_version
        return self.served.stamp(trajectory.channel)

    async def init(self, prompt_uid: str | None, channel: str | None, n_rollouts: int | None,
                   metadata: dict[str, Any] | None, policy_version: int | None, wait: float = 0.0) -> Trajectory:
        if not prompt_uid:
            raise missing_prompt_uid()
        trajectory = Trajectory(trajectory_uid=new_trajectory_uid(),
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
            raise not_found(f"unknown trajectory {trajectory_uid!r}: {GET_A_BASE_URL}")
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

    async def publish_call(self, trajectory: Trajectory, prompt: Prompt, choices: Sequence[SampledChoice],
                           version: int, conversation: list[dict[str, Any]], backend: str) -> list[Step]:
        """Publish a black-box call's steps, one per choice, once the engine answered: their indices taken
        under the trajectory's publish lock (for good: a record whose fate is unknown may still land), each
        placed in the trajectory's token sequence, acknowledged by the broker, then recorded with the
        conversation and the tokens the next call continues. 409 when the trajectory was completed since."""
        uid = trajectory.trajectory_uid
        async with self.publishing(uid):  # the context this prompt continued is the last
            try:
                first = await self.store.write(self.store.take_steps, uid, len(choices))
            except LookupError as exc:  # completed by a concurrent request since it was looked up
                raise conflict(str(exc)) from None
            new_segment = prompt.new_segment or self.store.context_step(uid) != trajectory.context_step
            steps = [Step(prompt_ids=prompt.ids, response_ids=sampled_ids(c.token_ids), trajectory_uid=uid,
                          prompt_uid=trajectory.prompt_uid, step_index=first + i, policy_version=version,
                          metadata={**trajectory.metadata, "finish_reason": c.finish_reason,
                                    **lineage(trajectory.context_step, first, i, new_segment)},
                          rollout_log_probs=array("d", c.logprobs), channel=trajectory.channel,
                          n_rollouts=trajectory.n_rollouts, version_segments=c.segments.wire(version))
                     for i, c in enumerate(choices)]
            await self.kafka.publish(steps, trajectory.channel, "chat", trajectory.n_rollouts)
            context = self.kafka.sent_context(uid, first)  # one context in memory, the producer's and ours
            if context is None:  # n > 1 choices (it kept the last one's), or no room for it
                context = joined(prompt.ids, steps[0].response_ids)
            await self.store.write(self.store.record_published, uid, first, len(steps), conversation, backend,
                                   context, first)
        return steps

    # -- white-box trajectories ---------------------------------------------------
    async def admit_generation(self, trajectory_uid: str | None, prompt_uid: str | None, channel: str | None,
                               step_index: int | None, policy_version: int | None, wait: float) -> None:
        """A white-box trajectory is admitted at its first ``/generate`` (step 0, not admitted yet); its later
        calls keep it from the idle timeout. Admission counts groups in flight by their prompt's id."""
        if trajectory_uid is None:
            return
        if self.pacing.admitted(trajectory_uid) or step_index:
            self.pacing.touch(trajectory_uid)
            return
        if self.pacing.active and prompt_uid is None:
            raise missing_prompt_uid()
        await self.pacing.admit(trajectory_uid, await self.channel(channel), prompt_uid, policy_version, wait)

    async def submit(self, steps: list[Step], channel: str | None, n_rollouts: int | None) -> tuple[int, str]:
        """Publish a white-box agent's own steps, acknowledged; a trajectory whose last step is among them is
        finished and leaves the backlog's in-flight count. Returns the count and the channel."""
        channel = await self.channel(channel)
        count = await self.kafka.publish(steps, channel, "submit_steps", n_rollouts)
        for step in steps:
            if step.is_last:
                self.pacing.release(step.trajectory_uid)
        return count, channel
