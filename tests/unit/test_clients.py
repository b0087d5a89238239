"""Each client role's configuration carries a replicated cluster's defaults; a call site's own settings win."""

from __future__ import annotations

import logging

import pytest

from trajbus.infra import clients
from trajbus.infra.client_roles import ClientLog
from trajbus.infra.kafka_config import KafkaConnection, configure

SCRAM = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "trainer",
         "sasl.password": "s3cret"}


@pytest.fixture(autouse=True)
def fresh_connection():
    configure({})
    yield
    configure(None)


@pytest.mark.parametrize("role", ["acked_producer", "transactional_producer"])
def test_producers_are_idempotent_acks_all_and_outlast_a_leader_election(role):
    config = clients.role_config(role, "b1:9092,b2:9092")
    assert config["bootstrap.servers"] == "b1:9092,b2:9092"
    assert config["enable.idempotence"] is True and config["acks"] == "all"
    assert config["delivery.timeout.ms"] >= 120_000 and config["request.timeout.ms"] == 30_000
    assert config["topic.metadata.refresh.interval.ms"] <= 60_000
    assert isinstance(config["logger"], ClientLog)  # librdkafka's lines still pass through Python logging


def test_a_transaction_outlives_its_records_delivery_timeout():
    config = clients.role_config("transactional_producer", "b:1", {"transactional.id": "worker-0"})
    assert config["transaction.timeout.ms"] >= config["delivery.timeout.ms"]


@pytest.mark.parametrize("role", ["trainer_consumer", "reader"])
def test_consumers_never_commit_on_their_own_and_read_committed(role):
    config = clients.role_config(role, "b:1")
    assert config["enable.auto.commit"] is False and config["isolation.level"] == "read_committed"
    assert "acks" not in config and "enable.idempotence" not in config  # producer properties only


def test_a_call_sites_settings_win_over_the_roles_defaults():
    own = logging.getLogger("trajbus.test")
    config = clients.role_config("acked_producer", "b:1", {"linger.ms": 0, "compression.type": "lz4",
                                                            "delivery.timeout.ms": 200_000, "logger": own})
    assert (config["linger.ms"], config["compression.type"], config["delivery.timeout.ms"]) == (0, "lz4", 200_000)
    assert config["logger"].logger is own and config["acks"] == "all"


def test_the_connection_comes_first_from_this_process_or_as_given():
    configure(SCRAM)
    assert clients.role_config("admin", "b:1")["sasl.username"] == "trainer"
    own = KafkaConnection("c:2", {"security.protocol": "SSL"})
    config = clients.role_config("admin", own)
    assert (config["bootstrap.servers"], config["security.protocol"]) == ("c:2", "SSL")
    assert "sasl.username" not in config
    assert "s3cret" not in repr(KafkaConnection.of("b:1")) and "sasl.username" in repr(KafkaConnection.of("b:1"))


def test_every_factory_builds_its_client_without_a_broker():
    """librdkafka checks the configuration when the client is created: every role's must pass."""
    producer = clients.acked_producer("127.0.0.1:1", {"log_level": 0})
    transactional = clients.transactional_producer("127.0.0.1:1", "test-tx", {"log_level": 0})
    trainer = clients.trainer_consumer("127.0.0.1:1", "test-group", {"log_level": 0})
    reader = clients.reader("127.0.0.1:1", {"log_level": 0})
    admin = clients.admin("127.0.0.1:1", {"log_level": 0})
    assert admin is not None
    producer.flush(0)
    transactional.flush(0)
    trainer.close()
    reader.close()
