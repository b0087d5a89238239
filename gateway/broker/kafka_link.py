"""The gateway's one link to Kafka: the acknowledged producer, the channels there are, the outage watch.

The link connects in a background thread, so the HTTP server answers (``/ready``
says what is missing) before Kafka does, and retries with backoff until it is connected,
for up to ``--broker-outage-limit`` seconds (then the gateway exits non-zero, as in an outage).
Publishing awaits the broker's acknowledgement on the event loop (no thread is
held while it waits), so a 200 still means the broker has the record; a record it did not take is a 503 that says what a
retry does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from trajbus.gateway.broker.channels import KnownChannels
from trajbus.gateway.config import GatewaySettings
from trajbus.gateway.errors import GatewayError, from_value_error, unavailable
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.prompts.token_ids import TOKEN_BYTES
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.clients import authentication_failure, cluster_metadata, explain
from trajbus.infra.kafka_config import connection_properties, redacted
from trajbus.infra.outage import OutageWatch
from trajbus.infra.retry import Stopped, retrying
from trajbus.infra.topics import admin_client
from trajbus.streams.client.producer import DeliveryError, StepProducer, TopicsUnavailable
from trajbus.streams.wire.prefix import Tokens
from trajbus.streams.wire.records import Step

log = logging.getLogger("trajbus.gateway")

TOPICS_LIST_TIMEOUT = 5.0
"""Seconds the broker has to list its topics when a call names a channel not known yet."""
STEPS_NOT_ACKNOWLEDGED = "a retry is a new step; the unacknowledged one is never part of the trajectory"
END_NOT_ACKNOWLEDGED = "retry complete_trajectory (the same end is sent again); the trajectory takes no more calls"


def prefix_memory_bytes(settings: GatewaySettings) -> int:
    """The producer's bound on its prefix bases: every trajectory held in memory at its longest context (a base
    dropped for want of room sends the trajectory's next step whole, a keyframe)."""
    return settings.cached_trajectories * (settings.prompt_length + settings.response_length) * TOKEN_BYTES


def kafka_failure(exc: DeliveryError, consequence: str) -> GatewayError:
    """503 for records the broker did not take, saying what a retry does."""
    if isinstance(exc, TopicsUnavailable):
        return unavailable(f"Kafka unavailable, nothing was sent: {exc}", code="kafka_unavailable")
    return unavailable(f"not acknowledged by the broker: {exc}; {consequence}", code="not_acknowledged")


class KafkaLink:
    """Connects, publishes acknowledged records, and knows the channels there are."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics,
                 on_connected: Callable[[str], None], give_up: Callable[[str], None]) -> None:
        self.settings, self.metrics = settings, metrics
        self._on_connected, self._give_up = on_connected, give_up
        self.producer: StepProducer | None = None
        self.outage: OutageWatch | None = None
        self.bootstrap_servers: str | None = None
        self.error: str | None = "connecting to Kafka"
        self.channels = KnownChannels(settings.prefix, settings.default_channel, settings.channels)
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._connect, name="kafka-connect", daemon=True).start()

    def _connect(self) -> None:
        """Resolve the broker, provision the default (and declared) channels, read the channels there are,
        tell the parts that follow Kafka (``on_connected``). Retried with backoff (``infra.retry``) for up to ``--broker-outage-limit``
        seconds, as an outage once connected is; past it the gateway gives up for a supervisor."""
        limit = self.settings.broker_outage_limit
        try:
            for attempt in retrying(limit, log, "kafka connect", stop=self._stop):
                with attempt:
                    self._connect_once()
        except Stopped:
            return
        except Exception:  # the last try's error is in self.error, which /ready said all along
            if not self._stop.is_set():
                self._give_up(f"Kafka not connected for {limit:g}s (--broker-outage-limit): {self.error}; "
                              "exiting for a supervisor to restart it")
            return
        if self._stop.is_set():
            return
        log.info("kafka producer ready bootstrap=%s prefix=%s channels=%s connection=%s", self.bootstrap_servers,
                 self.settings.prefix, ",".join(self.channels.known()), redacted(connection_properties()))
        self.outage = OutageWatch(self.bootstrap_servers, limit, self._give_up,
                                  what="gateway (calls are answered 503)").start()

    def _connect_once(self) -> None:
        """One try of ``_connect``; its failure is what ``/ready`` says."""
        servers, producer = None, None
        try:
            servers = resolve_bootstrap_servers(self.settings.bootstrap_servers)
            producer = StepProducer(servers, prefix=self.settings.prefix, timeout=self.settings.publish_timeout,
                                    prefix_memory_bytes=prefix_memory_bytes(self.settings))
            for channel in self.channels.provisioned_at_start:
                producer.provision(channel)
            admin = admin_client(servers)
            self.channels.connect(lambda: cluster_metadata(admin, TOPICS_LIST_TIMEOUT).topics)
            self._on_connected(servers)
            self.producer, self.error, self.bootstrap_servers = producer, None, servers
        except Exception as exc:  # reported by /ready; retried
            if producer is not None:
                producer.close()
            refused = authentication_failure(servers)
            self.error = explain(exc) if refused else f"Kafka not reachable: {exc}"
            raise

    def close(self) -> None:
        """Stop connecting and watching; flush and close the producer."""
        self._stop.set()
        if self.outage is not None:
            self.outage.stop()
        if self.producer is not None:
            self.producer.close()

    # -- readiness --------------------------------------------------------------
    def missing(self) -> str | None:
        """Why Kafka cannot take records now; None when it can."""
        if self.producer is None:
            return self.error or "Kafka producer not ready"
        if self.outage is not None and self.outage.down_since is not None:
            return f"Kafka unreachable for {time.time() - self.outage.down_since:.0f}s"
        return None

    def require(self) -> StepProducer:
        """The producer, or 503 while it is not connected."""
        if self.producer is None:
            raise unavailable(self.error or "Kafka producer not ready")
        return self.producer

    # -- records ----------------------------------------------------------------
    async def publish(self, steps: list[Step | dict[str, Any]], channel: str, source: str,
                      n_rollouts: int | None = None) -> int:
        """Publish steps and return once the broker acknowledged every one."""
        producer = self.require()
        started = time.monotonic()
        try:
            count = await producer.submit_steps_async(steps, channel, n_rollouts)
        except ValueError as exc:
            raise from_value_error(exc) from None
        except DeliveryError as exc:
            raise kafka_failure(exc, STEPS_NOT_ACKNOWLEDGED) from None
        self.metrics.publish_latency.observe(time.monotonic() - started)
        self.metrics.steps_of[channel, source].inc(count)
        for step in steps:
            if isinstance(step, Step):
                self.metrics.tokens_of["prompt"].inc(len(step.prompt_ids))
                self.metrics.tokens_of["response"].inc(len(step.response_ids))
                if step.is_last:
                    self.metrics.reward.labels(str(step.policy_version)).observe(step.reward)
        return count

    def sent_context(self, trajectory_uid: str, step_index: int) -> Tokens | None:
        """The producer's own copy of a sent step's prompt + response (``StepProducer.sent_context``), for a
        caller that would otherwise keep a second one."""
        return self.require().sent_context(trajectory_uid, step_index)

    async def ensure_channel(self, channel: str) -> None:
        """Make sure a channel's topics are all there (once: the channel check found its steps topic; a missing
        topic beside it is made) before a step index is taken for it."""
        producer = self.require()
        if producer.is_provisioned(channel):  # every call but a channel's first: no thread hop
            return
        try:
            await asyncio.to_thread(producer.provision, channel)
        except DeliveryError as exc:
            raise kafka_failure(exc, STEPS_NOT_ACKNOWLEDGED) from None

    async def end_trajectory(self, trajectory_uid: str, prompt_uid: str, reward: float, channel: str,
                             n_rollouts: int | None, metadata: dict[str, Any], steps: list[int] | None) -> None:
        """Publish a trajectory's end, acknowledged; ``DeliveryError`` / ``TopicsUnavailable`` as the producer's."""
        producer = self.require()
        await producer.complete_trajectory_async(trajectory_uid, prompt_uid, reward, channel, n_rollouts, metadata,
                                                 steps)
