"""Topic provisioning and inspection against any Kafka cluster.

Knows nothing of trajbus's topic names: callers pass ``TopicSpec`` s (the names
and settings live with the wire contract in ``streams.wire.topics``). Provisioning is
idempotent: missing topics are created, existing ones get their configs set to
the spec. Their partition counts are never changed implicitly: a raised count moves
keys (prompt groups) between partitions, and a worker sized for the old count misses
the new ones. Only ``grow_partitions`` raises one (``trajbus topics --create --steps-partitions N``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Collection, Iterator

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewPartitions,
    NewTopic,
    ResourceType,
)
from confluent_kafka.error import KafkaError

from trajbus.infra import clients
from trajbus.infra.clients import RefusedCredentials, cluster_metadata
from trajbus.infra.retry import retrying

log = logging.getLogger(__name__)


CLUSTER_DEFAULT = -1
"""A replication factor that leaves it to the cluster's ``default.replication.factor`` (KIP-464)."""


class ReplicationError(ValueError):
    """The cluster cannot hold the replication asked for: names the topic and the numbers."""


@dataclass(frozen=True)
class TopicSpec:
    """One topic as it should exist: name, partition count, topic configs and replicas
    (``CLUSTER_DEFAULT``: as many as the cluster gives its topics)."""

    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)
    replication_factor: int = CLUSTER_DEFAULT


@dataclass
class TopicInfo:
    """One topic as it exists: partitions with their offsets, and its explicit configs."""

    name: str
    partitions: int
    start_offsets: list[int]
    end_offsets: list[int]
    config: dict[str, str]

    @property
    def records(self) -> int:
        """Records currently retained (end minus start, summed over partitions)."""
        return sum(end - start for start, end in zip(self.start_offsets, self.end_offsets))


def admin_client(bootstrap_servers: str) -> AdminClient:
    return clients.admin(bootstrap_servers, {"logger": log})


def _wait(futures: dict, what: str, ignore: tuple[int, ...] = ()) -> None:
    for key, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.code() in ignore:
                continue
            raise RuntimeError(f"{what} {key}: {error.str()}") from exc




def ensure_topics(bootstrap_servers: str, specs: list[TopicSpec], timeout: float = 30.0,
                  grow_partitions: bool | Collection[str] = False) -> list[str]:
    """Make every spec true on the cluster; return the names that were created. A replication the
    cluster cannot hold is refused before anything is written (``ReplicationError``); an existing
    topic with fewer replicas than asked is named in a warning, never changed. What a leader
    election or a node's death makes fail is tried again for up to ``timeout`` seconds.

    An existing topic keeps its partition count (module docstring): one with fewer partitions than
    its spec is named in one warning line per process, unless ``grow_partitions`` asks to raise it
    on purpose (``True``: every spec's topic; a collection: the topics it names)."""
    admin = admin_client(bootstrap_servers)
    grow = {s.name for s in specs} if grow_partitions is True else set(grow_partitions or ())
    created: list[str] = []
    for attempt in retrying(timeout, log, "provisioning topics", permanent=(ReplicationError, RefusedCredentials)):
        with attempt:
            created += _ensure(admin, specs, timeout, grow)
            # every topic, not only this try's: one an earlier try created may still lack a leader
            _wait_for_leaders(admin, [spec.name for spec in specs], timeout)
    return created


def _ensure(admin: AdminClient, specs: list[TopicSpec], timeout: float, grow_names: set[str]) -> list[str]:
    metadata = cluster_metadata(admin, timeout)
    existing = metadata.topics
    missing = [spec for spec in specs if spec.name not in existing]
    _check_replication(admin, missing, len(metadata.brokers), timeout)
    _warn_under_replicated(admin, [s for s in specs if s.name in existing], existing, len(metadata.brokers), timeout)
    if missing:
        futures = admin.create_topics(
            [NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication_factor,
                      config=dict(s.config)) for s in missing],
            operation_timeout=timeout, request_timeout=timeout,
        )
        # Another process may create the same topic at the same moment: that is success too.
        _wait(futures, "creating topic", ignore=(KafkaError.TOPIC_ALREADY_EXISTS,))
        log.info("created topics %s", ", ".join(s.name for s in missing))

    present = [spec for spec in specs if spec.name in existing]
    grow = [s for s in present if s.name in grow_names and len(existing[s.name].partitions) < s.partitions]
    _note_partitions([s for s in present if s not in grow], existing)
    if grow:
        log.info("raising partitions of %s", ", ".join(f"{s.name} to {s.partitions}" for s in grow))
        _wait(admin.create_partitions([NewPartitions(s.name, s.partitions) for s in grow],
                                      request_timeout=timeout), "adding partitions to")
    with_config = [s for s in present if s.config]
    if with_config:
        resources = [
            ConfigResource(ResourceType.TOPIC, s.name, incremental_configs=[
                ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in s.config.items()
            ])
            for s in with_config
        ]
        _wait(admin.incremental_alter_configs(resources, request_timeout=timeout), "configuring topic")
    return [s.name for s in missing]


def cluster_replication(admin: AdminClient, timeout: float) -> int:
    """The cluster's ``default.replication.factor`` (what ``CLUSTER_DEFAULT`` gives), as a broker reports it."""
    broker = next(iter(admin.list_topics(timeout=timeout).brokers))
    futures = admin.describe_configs([ConfigResource(ResourceType.BROKER, str(broker))], request_timeout=timeout)
    entries = next(iter(futures.values())).result()
    return int(entries["default.replication.factor"].value)


def _check_replication(admin: AdminClient, specs: list[TopicSpec], brokers: int, timeout: float) -> None:
    """Refuse, before creating any, topics the cluster cannot hold: more replicas than brokers, or a
    ``min.insync.replicas`` above the replicas (every acknowledged write would then fail)."""
    default: int | None = None
    for spec in specs:
        replicas = spec.replication_factor
        if replicas == CLUSTER_DEFAULT and "min.insync.replicas" in spec.config:
            default = cluster_replication(admin, timeout) if default is None else default
            replicas = default
        if replicas > brokers:
            raise ReplicationError(f"topic {spec.name}: replication factor {replicas} needs {replicas} brokers, "
                                   f"the cluster has {brokers} available")
        in_sync = int(spec.config.get("min.insync.replicas", 0))
        if replicas != CLUSTER_DEFAULT and in_sync > replicas:
            raise ReplicationError(f"topic {spec.name}: min.insync.replicas {in_sync} is above its replication "
                                   f"factor {replicas}: no write could be acknowledged")


_warned: set[str] = set()


def _warn_under_replicated(admin: AdminClient, specs: list[TopicSpec], existing: dict, brokers: int,
                           timeout: float) -> None:
    """One warning line per topic (per process) that exists with fewer replicas than asked."""
    default: int | None = None
    for spec in specs:
        partitions = existing[spec.name].partitions
        if spec.name in _warned or not partitions:
            continue
        actual = min(len(p.replicas) for p in partitions.values())
        if actual >= max(brokers, spec.replication_factor):
            continue  # as many as asked (the default cannot exceed the brokers)
        if spec.replication_factor == CLUSTER_DEFAULT and default is None:
            default = cluster_replication(admin, timeout)
        wanted = default if spec.replication_factor == CLUSTER_DEFAULT else spec.replication_factor
        if actual < wanted:
            _warned.add(spec.name)
            log.warning("topic %s has %d replicas, fewer than the %d asked for; it is left as it is "
                        "(raise them with kafka-reassign-partitions)", spec.name, actual, wanted)


_partitions_noted: set[str] = set()


def _note_partitions(specs: list[TopicSpec], existing: dict) -> None:
    """One line per topic (per process) whose partition count differs from its spec, left as it is: a warning
    where the spec asks for more, information where it asks for fewer (Kafka cannot lower a count)."""
    for spec in specs:
        actual = len(existing[spec.name].partitions)
        if spec.name in _partitions_noted or not actual or actual == spec.partitions:
            continue
        _partitions_noted.add(spec.name)
        if actual < spec.partitions:
            log.warning("topic %s has %d partitions, not the %d asked for; left at %d (a count is raised only on "
                        "purpose: `trajbus topics --create --steps-partitions %d`, --groups-partitions for groups)",
                        spec.name, actual, spec.partitions, actual, spec.partitions)
        else:
            log.info("topic %s has %d partitions, more than the %d asked for; left at %d",
                     spec.name, actual, spec.partitions, actual)


def partition_counts(bootstrap_servers: str, names: list[str], timeout: float = 10.0) -> dict[str, int]:
    """The partition count of each named topic that exists (a missing one is left out)."""
    topics = cluster_metadata(admin_client(bootstrap_servers), timeout).topics
    return {name: len(topics[name].partitions) for name in names
            if name in topics and topics[name].error is None and topics[name].partitions}


_LEADERLESS = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
               KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION, KafkaError._TIMED_OUT)


class _Leaderless(KafkaException):
    """A partition without a leader yet (one being elected): asked again, quietly."""


class _NoLeadersYet(RuntimeError):
    """A new topic's partitions have no leaders yet: asked again, quietly."""


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout: float) -> None:
    """A created topic is usable once every partition has a leader; wait for that (``infra.retry``)."""
    for attempt in retrying(timeout, log, "waiting for the leaders of new topics", transient=(_NoLeadersYet,),
                            level=logging.DEBUG, first_wait=0.05):
        with attempt:
            topics = cluster_metadata(admin, timeout).topics
            if not all(name in topics and topics[name].error is None and topics[name].partitions
                       and all(p.leader >= 0 for p in topics[name].partitions.values()) for name in names):
                raise _NoLeadersYet(f"topics {names} have no leaders after {timeout}s")


def watermarks(probe: Consumer, partition: TopicPartition, timeout: float) -> tuple[int, int]:
    """Log start and end offsets; retried while a new partition's leader is being elected."""
    for attempt in retrying(timeout, log, f"watermarks of {partition.topic}[{partition.partition}]",
                            transient=(_Leaderless,), level=logging.DEBUG, first_wait=0.05):
        with attempt:
            try:
                return probe.get_watermark_offsets(partition, timeout=timeout)
            except KafkaException as exc:
                if exc.args[0].code() in _LEADERLESS:
                    raise _Leaderless(*exc.args) from None
                raise
    raise AssertionError("unreachable: the retry returns or raises")


def describe_topics(bootstrap_servers: str, names: list[str] | None = None, prefix: str | None = None,
                    timeout: float = 10.0) -> list[TopicInfo]:
    """Partitions, retained offsets and explicitly set configs of the named topics."""
    admin = admin_client(bootstrap_servers)
    metadata = cluster_metadata(admin, timeout).topics
    chosen = sorted(
        name for name in metadata
        if (names is None or name in names) and (prefix is None or name.startswith(prefix))
    )
    if not chosen:
        return []
    config_futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, n) for n in chosen],
                                            request_timeout=timeout)
    configs: dict[str, dict[str, str]] = {}
    for resource, future in config_futures.items():
        entries = future.result()
        configs[resource.name] = {
            key: entry.value for key, entry in entries.items()
            if entry.source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value
        }
    probe = clients.reader(bootstrap_servers, {"group.id": "trajbus.describe", "logger": log})
    try:
        infos = []
        for name in chosen:
            starts, ends = [], []
            for partition in sorted(metadata[name].partitions):
                low, high = watermarks(probe, TopicPartition(name, partition), timeout)
                starts.append(low)
                ends.append(high)
            infos.append(TopicInfo(name, len(starts), starts, ends, configs.get(name, {})))
        return infos
    finally:
        probe.close()


def delete_records_before(bootstrap_servers: str, topic: str, partition: int, offset: int,
                          timeout: float = 30.0) -> int:
    """Advance the log start of one partition to ``offset`` (Kafka's DeleteRecords); returns the new start."""
    admin = admin_client(bootstrap_servers)
    futures = admin.delete_records([TopicPartition(topic, partition, offset)], request_timeout=timeout)
    for future in futures.values():
        return future.result().low_watermark
    raise RuntimeError(f"no answer deleting records of {topic}[{partition}]")


def end_offsets_of(bootstrap_servers: str, partitions: list[tuple[str, int]], timeout: float = 10.0) -> dict[tuple[str, int], int]:
    """The end (high watermark) of each (topic, partition)."""
    probe = clients.reader(bootstrap_servers, {"group.id": "trajbus.end-offsets", "logger": log})
    try:
        return {(topic, p): watermarks(probe, TopicPartition(topic, p), timeout)[1] for topic, p in partitions}
    finally:
        probe.close()


class UnservedRead(RuntimeError):
    """A direct read of a partition that the broker did not serve (a broker away, a leader moving)."""


def read_partition(consumer: Consumer, topic: str, partition: int, start: int, end: int) -> Iterator[Message]:
    """Records of one partition with ``start <= offset < end``, in order (fewer where the log has gaps).

    ``consumer`` is assigned to the partition for the read; it needs ``enable.partition.eof``. A read
    the broker does not serve (no record within 5 s, or an error of the partition) raises
    ``UnservedRead``: a caller that retries while Kafka is away tells it from a bug by its type.
    """
    if start >= end:
        return
    consumer.assign([TopicPartition(topic, partition, start)])
    while True:
        message = consumer.poll(5.0)
        if message is None:
            raise UnservedRead(f"no records from {topic}[{partition}] at {start}..{end - 1} within 5 s")
        error = message.error()
        if error is not None and error.code() != KafkaError._PARTITION_EOF:
            if message.topic() == topic:
                raise UnservedRead(f"reading {topic}[{partition}]: {error.str()}")
            log.info("reading %s[%d]: client event %s", topic, partition, error.str())  # e.g. a reconnect
            continue
        if error is not None or message.offset() >= end:
            return  # end of the partition, or past the range
        yield message
        if message.offset() >= end - 1:
            return
