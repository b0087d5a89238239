"""One Kafka connection for every client: properties file, environment, flags; checked before connecting."""

from __future__ import annotations

import logging
import os
import time

import pytest

from trajbus.infra.clients import client_config
from trajbus.infra.kafka_config import (KafkaConfigError, configure, faust_credentials, from_environment,
                                        kafka_python_settings, read_properties_file, redacted)
from trajbus.pipelines import cli

SCRAM = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "trainer",
         "sasl.password": "s3cret"}


@pytest.fixture(autouse=True)
def fresh_connection():
    yield
    configure(None)


def test_a_properties_file_is_overridden_by_the_environment(tmp_path):
    path = tmp_path / "client.properties"
    path.write_text("# a comment\nsecurity.protocol=SASL_SSL\nsasl.mechanism: PLAIN\nsasl.username=a\n"
                    "sasl.password=from-file\n! also a comment\nclient.id = trainer-7\n")
    assert read_properties_file(path)["client.id"] == "trainer-7"
    properties = from_environment({"TRAJBUS_KAFKA_CONFIG": str(path), "TRAJBUS_KAFKA_SASL_PASSWORD": "from-env",
                                   "TRAJBUS_BOOTSTRAP_SERVERS": "ignored:9092", "HOME": "/root"})
    assert properties == {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "a",
                          "sasl.password": "from-env", "client.id": "trainer-7"}


def test_every_client_gets_the_connection_and_keeps_its_own_settings():
    configure(SCRAM)
    config = client_config("broker:9093", {"group.id": "g", "client.id": "mine"})
    assert callable(config.pop("error_cb"))  # remembers a refused authentication, tells an outage once
    assert config.pop("logger").logger.name == "trajbus.kafka"  # librdkafka's lines through Python logging
    assert config == {"bootstrap.servers": "broker:9093", **SCRAM, "group.id": "g", "client.id": "mine"}
    credentials = faust_credentials()
    assert (credentials.username, credentials.password, credentials.mechanism.value) == ("trainer", "s3cret",
                                                                                        "SCRAM-SHA-256")
    assert "s3cret" not in repr(credentials)
    assert kafka_python_settings() == {"security_protocol": "SASL_PLAINTEXT", "ssl_context": None,
                                       "sasl_mechanism": "SCRAM-SHA-256", "sasl_plain_username": "trainer",
                                       "sasl_plain_password": "s3cret"}


def test_the_pure_python_clients_get_the_same_connection():
    assert kafka_python_settings({}) == {"security_protocol": "PLAINTEXT", "ssl_context": None}
    tls = kafka_python_settings({"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "none"})
    assert tls["security_protocol"] == "SSL" and tls["ssl_context"].check_hostname is False
    with pytest.raises(KafkaConfigError, match="kafka-python supports PLAIN and SCRAM here, not GSSAPI"):
        kafka_python_settings({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "GSSAPI"})


@pytest.mark.parametrize("properties, says", [
    ({"security.protocol": "SASL_TLS"}, "security.protocol: unknown protocol 'SASL_TLS'"),
    ({**SCRAM, "sasl.mechanism": "SCRAM-SHA-1"}, "sasl.mechanism: unknown mechanism 'SCRAM-SHA-1'"),
    ({**SCRAM, "sasl.password": ""}, "sasl.password: missing"),
    ({"sasl.mechanism": "PLAIN"}, "sasl.mechanism: given, but security.protocol is PLAINTEXT"),
    ({"security.protocol": "SSL", "ssl.ca.location": "/nowhere/ca.pem"}, "ssl.ca.location: no such file"),
])
def test_bad_connection_settings_are_named(properties, says):
    with pytest.raises(KafkaConfigError, match=says.replace("(", r"\(")):
        configure(properties)


def test_secrets_are_never_shown():
    shown = redacted({**SCRAM, "ssl.key.password": "k", "sasl.oauthbearer.client.secret": "c"})
    assert shown["sasl.username"] == "trainer" and "s3cret" not in str(shown) and set(shown.values()) >= {"***"}
    assert shown["ssl.key.password"] == shown["sasl.oauthbearer.client.secret"] == "***"


@pytest.mark.parametrize("flags, says", [
    (["--kafka-property", "security.protocol=BOGUS"], "security.protocol: unknown protocol 'BOGUS'"),
    (["--kafka-property", "security.protocol=SASL_SSL", "--kafka-property", "sasl.mechanism=PLAIN"],
     "sasl.username: missing"),
    (["--kafka-config", "/nowhere/client.properties"], "kafka config: cannot read /nowhere/client.properties"),
])
def test_the_cli_says_what_is_wrong_in_one_line_and_exits_2(flags, says, monkeypatch, capsys):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the flags go to the environment: keep it to this test
    assert cli.main(["topics", "--bootstrap-servers", "127.0.0.1:1", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_a_crash_from_a_lost_connection_is_told_from_any_other():
    from aiokafka.errors import KafkaConnectionError

    from trajbus.streams.worker.logs import lost_kafka

    try:
        try:
            raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 9092)]")
        except KafkaConnectionError as exc:
            raise RuntimeError("the fetcher crashed") from exc
    except RuntimeError as crash:
        assert lost_kafka(crash)
    assert not lost_kafka(ValueError("a bug")) and not lost_kafka(None)


def test_a_direct_read_the_broker_does_not_serve_is_a_lost_connection_not_a_bug():
    """The worker's reconciliation reads the groups topic itself; while the broker restarts a read gets
    no record in time: that failure waits for Kafka (one WARNING a streak), it is not an ERROR."""
    from trajbus.infra.topics import UnservedRead, read_partition
    from trajbus.streams.worker.logs import lost_kafka

    class SilentConsumer:
        def assign(self, partitions) -> None:
            self.assigned = partitions

        def poll(self, timeout: float) -> None:
            return None

    with pytest.raises(UnservedRead, match=r"no records from t\[0\] at 3\.\.4") as raised:
        list(read_partition(SilentConsumer(), "t", 0, 3, 5))
    assert lost_kafka(raised.value)


def test_the_worker_waits_for_kafka_under_the_one_retry_policy_and_counts_the_whole_outage(monkeypatch):
    """Provisioning is retried while the outage, begun before a restart, is within the limit; past it,
    ``KafkaUnreachable``; a replication the cluster cannot hold is not retried."""
    from confluent_kafka import KafkaException

    from trajbus.infra.outage import KafkaUnreachable
    from trajbus.infra.topics import ReplicationError
    from trajbus.streams.worker import process as worker

    failures = [KafkaException("down"), KafkaException("down")]

    def ensure(servers, specs, timeout):
        if failures:
            raise failures.pop()

    monkeypatch.setattr(worker, "ensure_topics", ensure)
    worker._provision("b:1", [], outage_limit=30)
    assert not failures  # two failures waited out
    failures.append(KafkaException("still down"))
    monkeypatch.setenv(worker.OUTAGE_SINCE, str(time.time() - 100))  # the restart's outage began 100 s ago
    with pytest.raises(KafkaUnreachable, match=r"unreachable for 100s \(--broker-outage-limit 30\)"):
        worker._provision("b:1", [], outage_limit=30)
    failures.append(ReplicationError("3 replicas asked, 1 broker"))
    with pytest.raises(ReplicationError):
        worker._provision("b:1", [], outage_limit=30)



def test_a_value_continued_with_a_backslash_is_one_value(tmp_path):
    """As Java reads it: a long JAAS line split over lines is one property, not bogus keys."""
    path = tmp_path / "client.properties"
    path.write_text("sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required \\\n"
                    "    username=\"trainer\" \\\n"
                    "    password=\"s3cret\";\n"
                    "client.id trainer-7\n")
    assert read_properties_file(path) == {
        "sasl.jaas.config": 'org.apache.kafka.common.security.plain.PlainLoginModule required '
                            'username="trainer" password="s3cret";',
        "client.id": "trainer-7"}


def test_library_lines_go_to_our_logger_and_self_resolving_retries_are_debug(caplog):
    """A fresh broker's "Coordinator load in progress: retrying" reads like an error to a newcomer: DEBUG;
    so is each failed connection attempt (an outage is told once, by ``infra.outage``)."""
    own = logging.getLogger("trajbus.streams.client.producer")
    config = client_config("broker:9093", {"logger": own})
    assert config["logger"].logger is own and client_config("b:1", config)["logger"] is config["logger"]
    with caplog.at_level(logging.DEBUG, logger="trajbus"):
        config["logger"].log(logging.WARNING, "%s [%s] %s", "GETPID", "rdkafka#producer-1",
                             "[thrd:main]: Failed to acquire idempotence PID from broker b:1/1: "
                             "Broker: Coordinator load in progress: retrying")
        config["logger"].log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "b:1/1: Connect failed")
        config["logger"].log(logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "unknown property")
    assert [(r.name, r.levelname, r.getMessage().split()[0]) for r in caplog.records] == [
        ("trajbus.streams.client.producer", "DEBUG", "GETPID"), ("trajbus.streams.client.producer", "DEBUG", "FAIL"),
        ("trajbus.streams.client.producer", "WARNING", "CONFWARN")]


def test_a_real_client_takes_the_logger(caplog):
    from confluent_kafka import Producer

    with caplog.at_level(logging.DEBUG, logger="trajbus.kafka"):
        producer = Producer(client_config("127.0.0.1:1", {"debug": "generic", "socket.timeout.ms": 100,
                                                          "error_cb": lambda _error: None}))  # no outage probe
        producer.poll(0.5)
        producer.flush(0)
    assert caplog.records and all(r.name == "trajbus.kafka" for r in caplog.records)
