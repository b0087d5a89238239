"""The Python producer API: submit steps and trajectory ends, acknowledged by the broker.

Every call validates all of its records before producing any (nothing partial
reaches Kafka), keys them by ``prompt_uid`` (one partition per prompt group, so
order within a group is kept), and returns only once the broker acknowledged
each record with ``acks=all`` on an idempotent producer.

Steps go out in wire schema v2: a step whose prompt extends the prompt + response
of its trajectory's previous step (as this producer sent it) is written as a
reference plus its new tokens (``streams.wire.prefix``), so a multi-turn trajectory
costs its distinct tokens, not turns x context.

A call waits only for its own delivery reports (``streams.client.delivery``), a thread's call
on a lock, a coroutine's (``submit_steps_async``, ``complete_trajectory_async``) on a
future, holding no thread; ``streams.client.sender`` encodes, queues and waits for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any, Iterable, Mapping

from confluent_kafka import KafkaException

from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.clients import acked_producer
from trajbus.infra.first_contact import CONNECT_TIMEOUT, first_contact
from trajbus.infra.kafka_config import error_words
from trajbus.infra.outage import KafkaUnreachable
from trajbus.infra.topics import ensure_topics
from trajbus.streams.client.delivery import DeliveryError, Poller, TopicsUnavailable
from trajbus.streams.client.sender import RecordSender
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.prefix import DEFAULT_MEMORY_BYTES, PrefixEncoder, Tokens
from trajbus.streams.wire.records import END_STEPS, Step, TrajectoryEnd
from trajbus.streams.wire.topics import DEFAULT_PREFIX, steps_topic, validate_channel

__all__ = ["DeliveryError", "StepProducer", "TopicsUnavailable"]

log = logging.getLogger(__name__)

STEP_PRODUCER_SETTINGS = {
    # Every call waits for its acknowledgement, so lingering only adds latency (measured on
    # an 8k-token step: acknowledged in 4.9 ms at linger.ms=1, 3.0 ms at 0); the records of one
    # call still share batches, queued behind the first while it is in flight.
    "linger.ms": 0,
    # One produce request in flight per broker: what the other callers queue meanwhile goes in the
    # next request together (a group commit), instead of up to five small requests each paying the
    # replication round trip. On a 3-node cluster (acks=all), 16 callers of one acknowledged step:
    # 225 -> 301 steps/s, 64 callers: 285 -> 433; one caller and one node unchanged. Order and
    # idempotence hold either way.
    "max.in.flight.requests.per.connection": 1,
    "compression.type": "lz4",
    # murmur2 is the Java client's partitioner: every producer of a topic,
    # in any language, must put one prompt_uid on the same partition.
    "partitioner": "murmur2_random",
}
"""librdkafka settings of every step producer (beside ``acked_producer``'s idempotence and ``acks=all``)."""


def _as_step(step: Step | Mapping[str, Any], channel: str, n_rollouts: int | None,
             encoder: PrefixEncoder) -> Step:
    if isinstance(step, Mapping):
        step = Step.from_dict(step)
    elif not isinstance(step, Step):
        raise ValueError(f"steps: expected Step or dict, got {type(step).__name__}")
    else:  # the prompt tokens its trajectory's last step sent are checked already (junk ids: checked whole)
        known = encoder.extended(step) if isinstance(step.trajectory_uid, str) and \
            isinstance(step.prompt_ids, (list, tuple)) else 0
        step.validate(known_prefix=known)
    if n_rollouts is not None and step.n_rollouts is None:
        step = dataclasses.replace(step, n_rollouts=n_rollouts)
    if step.channel is None:
        return dataclasses.replace(step, channel=channel)
    if step.channel != channel:
        raise ValueError(f"channel: step {step.trajectory_uid}#{step.step_index} says {step.channel!r} "
                         f"but was submitted to {channel!r}")
    return step


def trajectory_end(trajectory_uid: str, prompt_uid: str, reward: float | None, channel: str,
                   n_rollouts: int | None, metadata: dict | None, steps: Iterable[int] | None) -> TrajectoryEnd:
    """The one place an end record is built and checked, for ``complete_trajectory`` and its async twin."""
    metadata = dict(metadata or {})
    if steps is not None:
        metadata[END_STEPS] = list(steps)
    return TrajectoryEnd(trajectory_uid=trajectory_uid, prompt_uid=prompt_uid, reward=reward,
                         channel=validate_channel(channel), n_rollouts=n_rollouts, metadata=metadata).validate()


class StepProducer:
    """Publishes step events to ``{prefix}.steps.{channel}``.

    Topics of a channel are provisioned on its first use (idempotent), so a new
    channel works without a separate set-up step. An existing topic keeps its
    partition count whatever ``settings`` say (one warning where they ask for more):
    raising it moves keys between partitions, so only ``trajbus topics`` does, on purpose.

    Constructing connects nothing. The first call (a submit, ``complete_trajectory`` or ``provision``)
    waits for the cluster's first answer, up to ``CONNECT_TIMEOUT`` (10 s) or ``timeout`` if shorter,
    unless a client of this process reached it before; without one it raises ``TopicsUnavailable``
    naming the address (a wrong address is one error, nothing sent). A cluster reached once is
    ridden through when it goes away: a call fails only past its ``timeout``.
    """

    def __init__(
        self,
        bootstrap_servers: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        settings: TopicSettings | None = None,
        timeout: float = 30.0,
        provision_topics: bool = True,
        prefix_memory_bytes: int = DEFAULT_MEMORY_BYTES,
        **config: Any,
    ) -> None:
        """``prefix_memory_bytes`` bounds the last contexts remembered per open trajectory (least recently
        used out first): a trajectory forgotten writes its next step whole."""
        self.bootstrap_servers = resolve_bootstrap_servers(bootstrap_servers)
        self.settings = settings or TopicSettings(prefix=prefix)
        self.prefix = self.settings.prefix
        self.timeout = timeout
        self.provision_topics = provision_topics
        self._provisioned: set[str] = set()
        self._provision_lock = threading.Lock()
        self._reached = False
        self._closed = False
        self._prefixes = PrefixEncoder(prefix_memory_bytes)
        self._producer = acked_producer(self.bootstrap_servers, {  # idempotent, acks=all
            "logger": log,  # librdkafka logs as structured Python log lines, not raw stderr
            **STEP_PRODUCER_SETTINGS,
            "message.max.bytes": self.settings.max_message_bytes,
            **config,
        })
        self._poller = Poller(self._producer)
        self._sender = RecordSender(self._producer, self._poller, self._prefixes)

    def sent_context(self, trajectory_uid: str, step_index: int) -> Tokens | None:
        """The prompt + response of a step this producer sent, as it keeps them to express the trajectory's
        next step (``PrefixEncoder.remembered``); None when it keeps none (a keyframe comes next)."""
        return self._prefixes.remembered(trajectory_uid, step_index)

    def is_provisioned(self, channel: str) -> bool:
        """Whether this producer already provisioned the channel's topics (no broker call)."""
        return channel in self._provisioned

    def provision(self, channel: str) -> None:
        """Create the channel's topics if missing (idempotent; done once per channel)."""
        validate_channel(channel)
        self._reach()
        with self._provision_lock:
            if channel not in self._provisioned:
                try:
                    ensure_topics(self.bootstrap_servers,
                                  self.settings.shared_specs() + self.settings.channel_specs(channel), self.timeout)
                except (KafkaException, RuntimeError) as exc:
                    raise TopicsUnavailable(f"topics of channel {channel!r} not provisioned: "
                                            f"{error_words(exc)}") from exc
                self._provisioned.add(channel)

    def _reach(self) -> None:
        """The first call's wait for the cluster's first answer (the class docstring): a wrong address
        is one error naming it, in ``CONNECT_TIMEOUT`` (or ``timeout``) seconds at most."""
        if self._reached:
            return
        try:
            first_contact(self.bootstrap_servers, min(self.timeout, CONNECT_TIMEOUT))
        except (KafkaUnreachable, KafkaException) as exc:
            raise TopicsUnavailable(f"{error_words(exc)}; nothing was sent") from None
        self._reached = True

    def _ready(self, channel: str) -> None:
        """Reached, and the channel's topics provisioned where this producer provisions them."""
        self._reach()
        if self.provision_topics and channel not in self._provisioned:
            self.provision(channel)

    def _topic(self, channel: str) -> str:
        topic = steps_topic(validate_channel(channel), self.prefix)
        if not self._reached or (self.provision_topics and channel not in self._provisioned):
            self._ready(channel)
        return topic

    async def _topic_async(self, channel: str) -> str:
        """``_topic``, its first contact and provisioning (blocking, once) on a worker thread."""
        topic = steps_topic(validate_channel(channel), self.prefix)
        if not self._reached or (self.provision_topics and channel not in self._provisioned):
            await asyncio.to_thread(self._ready, channel)
        return topic

    def _steps(self, steps: Iterable[Step | Mapping[str, Any]], channel: str, n_rollouts: int | None) -> list[Step]:
        """Every step checked (all before any is sent), with its channel and group size set."""
        if isinstance(steps, (Step, Mapping)):  # iterating a dict gives its keys: name the real mistake
            raise ValueError(f"steps: expected a list of steps, got a single {type(steps).__name__}; "
                             "pass a list, e.g. submit_steps([step])")
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise ValueError(f"steps: expected a list of steps (Step or dict), got {type(steps).__name__}")
        validate_channel(channel)
        if n_rollouts is not None and (type(n_rollouts) is not int or n_rollouts < 1):
            raise ValueError(f"n_rollouts: must be a positive integer, got {n_rollouts!r}")
        return [_as_step(step, channel, n_rollouts, self._prefixes) for step in steps]

    def submit_steps(self, steps: Iterable[Step | Mapping[str, Any]], channel: str = "train",
                     n_rollouts: int | None = None) -> int:
        """Publish steps (``Step`` or dicts); returns how many the broker acknowledged.

        ``n_rollouts`` registers the group size on steps that carry none, so the
        worker waits for that many trajectories instead of the channel default.
        """
        records = self._steps(steps, channel, n_rollouts)
        if not records:
            return 0
        return self._sender.publish(self._topic(channel), records, self.timeout)

    async def submit_steps_async(self, steps: Iterable[Step | Mapping[str, Any]], channel: str = "train",
                                 n_rollouts: int | None = None) -> int:
        """``submit_steps`` for an event loop: the same checks, errors and guarantee (it returns once the
        broker acknowledged every record), awaited without a thread.

        Checking and encoding the steps run in the caller's thread, the loop's, before the first await:
        they hold the GIL either way (about 0.1-0.3 ms a 2-10k-token step), so a worker thread would
        only add a hand-off. A channel's first call provisions its topics on a worker thread. Cancelled
        while waiting, the call's records may still reach the broker: as after a ``DeliveryError``, the
        caller does not know, and the trajectories' next steps are written whole.
        """
        records = self._steps(steps, channel, n_rollouts)
        if not records:
            return 0
        return await self._sender.publish_async(await self._topic_async(channel), records, self.timeout)

    def complete_trajectory(self, trajectory_uid: str, prompt_uid: str, reward: float | None = None,
                            channel: str = "train", n_rollouts: int | None = None, metadata: dict | None = None,
                            steps: Iterable[int] | None = None) -> None:
        """Mark a trajectory complete; ``reward``, when given, lands on its last step.

        ``steps``, when given, names the trajectory's step indices exactly (``END_STEPS``): the
        worker waits for those and leaves any other step of the trajectory out.
        """
        end = trajectory_end(trajectory_uid, prompt_uid, reward, channel, n_rollouts, metadata, steps)
        self._sender.publish(self._topic(channel), [end], self.timeout)

    async def complete_trajectory_async(self, trajectory_uid: str, prompt_uid: str, reward: float | None = None,
                                        channel: str = "train", n_rollouts: int | None = None,
                                        metadata: dict | None = None, steps: Iterable[int] | None = None) -> None:
        """``complete_trajectory`` for an event loop, as ``submit_steps_async`` is ``submit_steps``'s."""
        end = trajectory_end(trajectory_uid, prompt_uid, reward, channel, n_rollouts, metadata, steps)
        await self._sender.publish_async(await self._topic_async(channel), [end], self.timeout)

    def close(self) -> None:
        """Deliver what is queued, then free the client (its threads end here, not at exit).
        Records still undelivered were never acknowledged to a caller: they are purged."""
        if self._closed:
            return
        self._closed = True
        remaining = self._producer.flush(self.timeout)
        self._poller.stop()
        if remaining:
            log.warning("producer closed with %d undelivered records", remaining)
            self._producer.purge()
        self._producer.close()

    def __enter__(self) -> "StepProducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
