"""What the gateway's routes share: components, readiness, publishing, trajectories.

The HTTP server starts answering before anything is ready; the tokenizer loads
and the Kafka producer connects in background threads, and ``/ready`` reports
what is still missing. Publishing runs the (blocking, acknowledged) producer
in a worker thread, so a 200 still means the broker has the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import sqlite3
import threading
import time
import uuid
import weakref
from typing import Any, Callable

from trajbus.gateway.admission import Admission
from trajbus.gateway.backends import BackendPool
from trajbus.gateway.backlog import BacklogMonitor
from trajbus.gateway.config import GatewaySettings
from trajbus.gateway.errors import GatewayError, bad_request, conflict, from_value_error, not_found, unavailable
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.rewards import RewardScorer, RewardUnavailable
from trajbus.gateway.tokenizer import ChatTokenizer
from trajbus.gateway.trajectories import ABANDONED, COMPLETED, COMPLETING, OPEN, Trajectory, TrajectoryStore
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.kafka_config import authentication_failure, connection_properties, explain, redacted
from trajbus.infra.outage import OutageWatch
from trajbus.streams.policy import PolicyWatcher
from trajbus.streams.producer import DeliveryError, StepProducer, TopicsUnavailable
from trajbus.streams.records import Step, validate_metadata
from trajbus.streams.topics import validate_channel

log = logging.getLogger("trajbus.gateway")


STEPS_NOT_ACKNOWLEDGED = "a retry is a new step; the unacknowledged one is never part of the trajectory"
END_NOT_ACKNOWLEDGED = "retry complete_trajectory (the same end is sent again); the trajectory takes no more calls"


def kafka_failure(exc: DeliveryError, consequence: str) -> GatewayError:
    """503 for records the broker did not take, saying what a retry does."""
    if isinstance(exc, TopicsUnavailable):
        return unavailable(f"Kafka unavailable, nothing was sent: {exc}", code="kafka_unavailable")
    return unavailable(f"not acknowledged by the broker: {exc}; {consequence}", code="not_acknowledged")


class GatewayService:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.tokenizer = ChatTokenizer(settings.tokenizer_path, settings.multi_turn)
        self.backends = BackendPool(settings.vllm_addresses, settings.backend_timeout, settings.health_interval)
        self.store = TrajectoryStore(settings.state_dir)
        self.rewards = RewardScorer(settings.reward_function, settings.reward_worker_name,
                                    settings.ray_address, settings.ray_namespace)
        self.producer: StepProducer | None = None
        self.bootstrap_servers: str | None = None
        self.policy: PolicyWatcher | None = None
        self.admission = Admission(settings.admission, settings.admission_by_channel, settings.idle_timeout,
                                   self.metrics)
        self.backlog: BacklogMonitor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task | None = None
        self.outage: OutageWatch | None = None
        self.stop_serving: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)
        """Ends the HTTP server gracefully (``gateway.server`` sets it to uvicorn's own exit flag)."""
        self.fatal: str | None = None
        """Why the gateway ended itself (Kafka unreachable past the limit): it then exits non-zero."""
        self.kafka_error: str | None = "connecting to Kafka"
        self.started_at = time.time()
        self._stop = threading.Event()
        self._publishing: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    # -- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for uid, channel, prompt_uid, updated_at in self.store.unfinished():  # admitted before a restart
            self.admission.add(uid, channel, prompt_uid, updated_at)
        self._sweeper = asyncio.create_task(self._sweep_state())
        self.tokenizer.load_in_background()
        threading.Thread(target=self._connect_kafka, name="kafka-connect", daemon=True).start()
        self.backends.start()
        log.info("gateway listening url=%s backends=%s state=%s", self.settings.base_address,
                 ",".join(self.settings.vllm_addresses), self.store.path)

    def _connect_kafka(self) -> None:
        """Resolve the broker, provision the default channel, follow the policy topic; retry until done."""
        while not self._stop.is_set():
            servers, producer = None, None
            try:
                servers = resolve_bootstrap_servers(self.settings.bootstrap_servers)
                producer = StepProducer(servers, prefix=self.settings.prefix, timeout=self.settings.publish_timeout)
                producer.provision(self.settings.default_channel)
                self.policy = PolicyWatcher(servers, prefix=self.settings.prefix)
                if self.admission.active:
                    self._watch_backlog(servers)
                self.producer, self.kafka_error, self.bootstrap_servers = producer, None, servers
                log.info("kafka producer ready bootstrap=%s prefix=%s connection=%s", servers, self.settings.prefix,
                         redacted(connection_properties()))
                self.outage = OutageWatch(servers, self.settings.broker_outage_limit, self._give_up,
                                          what="gateway (calls are answered 503)").start()
                return
            except Exception as exc:  # reported by /ready; retried
                if producer is not None:
                    producer.close()
                refused = authentication_failure(servers)
                self.kafka_error = explain(exc) if refused else f"Kafka not reachable: {exc}"
                log.warning("kafka connect failed, retrying: %s", self.kafka_error)
                self._stop.wait(2.0)

    def _give_up(self, reason: str) -> None:
        """Kafka stayed away past ``--broker-outage-limit``: stop serving (graceful), exit non-zero."""
        self.fatal = reason
        log.error("%s", reason)
        self.stop_serving()  # graceful shutdown; serve() then exits 1 with the reason

    def _watch_backlog(self, servers: str) -> None:
        backlog = BacklogMonitor(servers, self.settings.prefix, BacklogMonitor.new_gateway_id(self.settings.port),
                                 self.admission.in_flight_counts,
                                 lambda: self._loop.call_soon_threadsafe(self._backlog_refreshed))
        backlog.watch(self.settings.default_channel)
        self.admission.ready, self.admission.elsewhere = backlog.ready, backlog.elsewhere
        self.backlog = backlog  # before its first refresh can reach the loop
        backlog.start()

    def _backlog_refreshed(self) -> None:
        """On the event loop, after each read of the signals: gauges, then held trajectories decide again."""
        for channel in self.backlog.channels():
            backlog = self.admission.backlog(channel)
            if backlog is not None:
                for kind in ("ready", "in_flight_here", "in_flight_elsewhere"):
                    self.metrics.backlog.labels(channel, kind).set(getattr(backlog, kind))
        self.admission.wake()

    async def _sweep_state(self) -> None:
        """Keep the trajectory state bounded (``TrajectoryStore.sweep``), and its size a metric."""
        interval = max(0.1, min(10.0, self.settings.idle_timeout / 4, self.settings.finished_retention / 4))
        while True:
            try:
                await asyncio.to_thread(self._sweep_once)
            except sqlite3.Error as exc:  # a full disk, say: the gateway keeps serving, the next sweep retries
                log.warning("trajectory state sweep failed: %s", exc)
            await asyncio.sleep(interval)

    def _sweep_once(self) -> None:
        now = time.time()
        abandoned, removed = self.store.sweep(now - self.settings.idle_timeout, now - self.settings.finished_retention)
        if abandoned:  # the admission's own idle rule has dropped them already
            self.metrics.trajectories.labels("abandoned").inc(len(abandoned))
        if abandoned or removed:
            log.info("trajectory state swept abandoned=%d removed=%d", len(abandoned), removed)
        counts = self.store.counts()
        for status in (OPEN, COMPLETING, COMPLETED, ABANDONED):
            self.metrics.state_trajectories.labels(status).set(counts.get(status, 0))
        self.metrics.state_bytes.set(self.store.bytes_in_use())

    async def close(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self.outage is not None:
            self.outage.stop()
        if self.backlog is not None:
            await asyncio.to_thread(self.backlog.close)
        await self.backends.close()
        if self.policy is not None:
            self.policy.close()
        if self.producer is not None:
            await asyncio.to_thread(self.producer.close)
        self.store.close()
        log.info("gateway stopped: producer flushed, trajectory state closed")

    def readiness(self) -> list[str]:
        """What is not ready yet; empty when the gateway can serve every endpoint."""
        missing = []
        if not self.tokenizer.ready:
            missing.append(self.tokenizer.error or "tokenizer is loading")
        if self.producer is None:
            missing.append(self.kafka_error or "Kafka producer not ready")
        elif self.outage is not None and self.outage.down_since is not None:
            missing.append(f"Kafka unreachable for {time.time() - self.outage.down_since:.0f}s")
        if not self.backends.ready:
            missing.append("no inference backend passes its health check")
        return missing

    def require(self, *parts: str) -> None:
        """503 unless the named parts (tokenizer, kafka, backend) are ready."""
        if "tokenizer" in parts and not self.tokenizer.ready:
            raise unavailable(self.tokenizer.error or "tokenizer is still loading")
        if "kafka" in parts and self.producer is None:
            raise unavailable(self.kafka_error or "Kafka producer not ready")
        if "backend" in parts and not self.backends.ready:
            raise unavailable("no inference backend passes its health check", code="no_backend")

    # -- publishing -------------------------------------------------------------
    async def publish(self, steps: list[Step | dict[str, Any]], channel: str, source: str,
                      n_rollouts: int | None = None) -> int:
        """Publish steps and wait for the broker's acknowledgement (in a worker thread)."""
        self.require("kafka")
        started = time.monotonic()
        try:
            count = await asyncio.to_thread(self.producer.submit_steps, steps, channel, n_rollouts)
        except ValueError as exc:
            raise from_value_error(exc) from None
        except DeliveryError as exc:
            raise kafka_failure(exc, STEPS_NOT_ACKNOWLEDGED) from None
        self.metrics.publish_latency.observe(time.monotonic() - started)
        self.metrics.steps.labels(channel, source).inc(count)
        for step in steps:
            if isinstance(step, Step):
                self.metrics.tokens.labels("prompt").inc(len(step.prompt_ids))
                self.metrics.tokens.labels("response").inc(len(step.response_ids))
                if step.is_last:
                    self.metrics.reward.labels(str(step.policy_version)).observe(step.reward)
        return count

    async def ensure_channel(self, channel: str) -> None:
        """Provision a channel's topics (once) before a step index is taken for it."""
        self.require("kafka")
        if self.producer.is_provisioned(channel):  # every call but a channel's first: no thread hop
            return
        try:
            await asyncio.to_thread(self.producer.provision, channel)
        except DeliveryError as exc:
            raise kafka_failure(exc, STEPS_NOT_ACKNOWLEDGED) from None

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
        version = self.policy.serving(trajectory.channel) if self.policy is not None else None
        return version if version is not None else 0

    # -- admission --------------------------------------------------------------
    async def admit(self, trajectory_uid: str, channel: str, prompt_uid: str, declared_version: int | None,
                    wait: float) -> None:
        """Admit a new trajectory or answer 429 (see ``gateway.admission``); no-op when pacing is off."""
        if not self.admission.active:
            return
        if wait > self.settings.max_admission_wait:
            raise bad_request(f"wait: at most {self.settings.max_admission_wait:g} seconds "
                              f"(--max-admission-wait), got {wait:g}", param="wait")

        def start_version() -> int | None:
            if declared_version is not None:
                return declared_version
            return self.policy.serving(channel) if self.policy is not None else None

        def trainer_version() -> int | None:
            return self.policy.current(channel) if self.policy is not None else None

        await self.admission.admit(trajectory_uid, channel, prompt_uid, start_version, trainer_version, wait)

    # -- trajectories -----------------------------------------------------------
    async def init_trajectory(self, prompt_uid: str | None, channel: str | None, n_rollouts: int | None,
                              metadata: dict[str, Any] | None, policy_version: int | None,
                              wait: float = 0.0) -> Trajectory:
        trajectory = Trajectory(trajectory_uid=secrets.token_urlsafe(18),  # 144 random bits: unguessable
                                prompt_uid=prompt_uid or uuid.uuid4().hex,
                                channel=self.channel(channel), n_rollouts=n_rollouts,
                                metadata=self._metadata(metadata), policy_version=policy_version)
        await self.admit(trajectory.trajectory_uid, trajectory.channel, trajectory.prompt_uid, policy_version, wait)
        self.store.create(trajectory)
        self.metrics.trajectories.labels("initialized").inc()
        log.info("trajectory initialized trajectory=%s prompt=%s channel=%s", trajectory.trajectory_uid,
                 trajectory.prompt_uid, trajectory.channel)
        return trajectory

    def channel(self, channel: str | None) -> str:
        try:
            return validate_channel(channel or self.settings.default_channel)
        except ValueError as exc:
            raise bad_request(str(exc), param="channel") from None

    @staticmethod
    def _metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
        try:
            validate_metadata(metadata or {})
        except ValueError as exc:
            raise from_value_error(exc) from None
        try:  # the wire carries it as UTF-8 JSON: a lone surrogate would fail only when a step is sent
            json.dumps(metadata or {}, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise bad_request("metadata: strings must be valid Unicode (a lone surrogate is not)",
                              param="metadata") from None
        return metadata or {}

    def trajectory(self, trajectory_uid: str, prompt_uid: str, open_only: bool = True) -> Trajectory:
        """The trajectory of a base_url: 404 if unknown, 409 if completed (when ``open_only``)."""
        trajectory = self.store.get(trajectory_uid)
        if trajectory is None or trajectory.prompt_uid != prompt_uid:
            raise not_found(f"unknown trajectory {trajectory_uid!r}: call POST /init_trajectory for a base_url")
        if open_only and trajectory.status != OPEN:
            raise conflict(f"trajectory {trajectory_uid} is {trajectory.status}")
        return trajectory

    def register(self, trajectory: Trajectory, channel: str | None, n_rollouts: int | None,
                 metadata: dict[str, Any] | None, policy_version: int | None) -> Trajectory:
        changes: dict[str, Any] = {}
        if channel is not None and channel != trajectory.channel:
            if trajectory.next_step:
                raise conflict("channel cannot change after the trajectory's first call")
            changes["channel"] = self.channel(channel)
        if n_rollouts is not None:
            changes["n_rollouts"] = n_rollouts
        if metadata:
            changes["metadata"] = self._metadata({**trajectory.metadata, **metadata})
        if policy_version is not None:
            changes["policy_version"] = policy_version
        if changes:
            self.store.update(trajectory.trajectory_uid, **changes)
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
            reward = await self.score(self.reward_input(trajectory))
        self.require("kafka")
        metadata = self._metadata(metadata)
        async with self.publishing(uid):  # calls in flight have published or failed: the list is final
            closed = self.store.transition(uid, OPEN, COMPLETING)  # from now on: no more calls
            current = self.store.get(uid)
            if not closed and current.status != COMPLETING:  # completing: an earlier end may land
                raise conflict(f"trajectory {uid} is already {current.status}")
            try:
                await asyncio.to_thread(self.producer.complete_trajectory, uid, trajectory.prompt_uid, reward,
                                        trajectory.channel, trajectory.n_rollouts, metadata, current.acknowledged)
            except TopicsUnavailable as exc:  # nothing was sent: the trajectory may go on
                self.store.transition(uid, COMPLETING, OPEN)
                raise kafka_failure(exc, END_NOT_ACKNOWLEDGED) from None
            except DeliveryError as exc:  # the end may still land: only a retry of the same end is accepted
                raise kafka_failure(exc, END_NOT_ACKNOWLEDGED) from None
            self.store.transition(uid, COMPLETING, COMPLETED)
        self.admission.release(uid)
        self.metrics.trajectories.labels("completed").inc()
        self.metrics.reward.labels(str(self.policy_version(trajectory))).observe(reward)
        log.info("trajectory completed trajectory=%s prompt=%s steps=%d reward=%s", uid, trajectory.prompt_uid,
                 current.published_steps, reward)
        return reward, current

    @staticmethod
    def reward_input(trajectory: Trajectory) -> dict[str, Any]:
        conversation = trajectory.last_conversation or []
        last = conversation[-1] if conversation and conversation[-1].get("role") == "assistant" else {}
        return {"trajectory_uid": trajectory.trajectory_uid, "prompt_uid": trajectory.prompt_uid,
                "channel": trajectory.channel, "metadata": trajectory.metadata, "messages": conversation,
                "response_text": last.get("content") or ""}

    async def score(self, payload: dict[str, Any]) -> float:
        try:
            return await self.rewards.score(payload)
        except RewardUnavailable as exc:
            raise GatewayError(400 if not self.rewards.configured else 503, str(exc), code="no_reward") from None
        except ValueError as exc:
            raise GatewayError(500, str(exc), type_="server_error", code="bad_reward") from None
        except Exception as exc:  # the deployment's reward function failed: its error, as JSON
            log.warning("reward function failed: %r", exc)
            raise GatewayError(500, f"the reward function failed: {exc!r}", type_="server_error",
                               code="reward_failed") from None

    def statistics(self) -> dict[str, Any]:
        def total(counter) -> dict[str, float]:
            return {"/".join(s.labels.values()) or "all": s.value for metric in counter.collect()
                    for s in metric.samples if s.name.endswith("_total")}

        return {"uptime_seconds": round(time.time() - self.started_at, 1),
                "ready": not self.readiness(), "not_ready": self.readiness(),
                "trajectories": self.store.counts(), "state_bytes": self.store.bytes_in_use(),
                "policy_versions": self.policy.versions() if self.policy is not None else {},
                "steps_published": total(self.metrics.steps),
                "tokens": total(self.metrics.tokens),
                "prompts": total(self.metrics.prompts),
                "requests": total(self.metrics.requests),
                "admissions": total(self.metrics.admissions),
                "backends": self.backends.describe(),
                "admission": self.admission_state()}

    def admission_state(self) -> dict[str, dict[str, Any]]:
        """Per channel watched: the limits and the backlog as this gateway sees it (None: not read yet)."""
        state = {}
        for channel in self.backlog.channels() if self.backlog is not None else []:
            rules, backlog = self.admission.rules(channel), self.admission.backlog(channel)
            state[channel] = {**dataclasses.asdict(rules), "backlog": None if backlog is None else
                              {**dataclasses.asdict(backlog), "total": backlog.total}}
        return state
