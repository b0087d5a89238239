"""Topic provisioning from one settings object, idempotent, and `trajbus topics`."""

from __future__ import annotations

import re

from trajbus.infra.topics import describe_topics, ensure_topics
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.topics import chunks_topic, groups_topic, policy_topic, prompts_topic, steps_topic
from tests.helpers import trajbus


def test_provisioning_is_idempotent_and_applies_settings(bootstrap_servers: str, prefix: str):
    settings = TopicSettings(prefix=prefix, steps_partitions=4, groups_retention_ms=123456,
                             groups_retention_bytes=7_000_000)
    specs = settings.specs(["train", "val"])
    assert sorted(ensure_topics(bootstrap_servers, specs)) == sorted(s.name for s in specs)
    assert ensure_topics(bootstrap_servers, specs) == []

    infos = {i.name: i for i in describe_topics(bootstrap_servers, prefix=f"{prefix}.")}
    assert set(infos) == {f"{prefix}.dlq", f"{prefix}.policy", f"{prefix}.stats", f"{prefix}.traces",
                          *(f"{prefix}.{k}.{c}" for k in ("steps", "groups", "chunks", "prompts")
                           for c in ("train", "val"))}
    assert infos[steps_topic("train", prefix)].partitions == 4
    assert infos[groups_topic("val", prefix)].partitions == 1
    groups_config = infos[groups_topic("train", prefix)].config
    assert groups_config["retention.ms"] == "123456"
    assert groups_config["retention.bytes"] == "7000000"
    assert groups_config["max.message.bytes"] == str(settings.max_message_bytes)
    chunks_config = infos[chunks_topic("train", prefix)].config  # chunks live as long as the groups naming them
    assert (chunks_config["retention.ms"], chunks_config["retention.bytes"]) == ("123456", "7000000")
    assert infos[policy_topic(prefix)].config["cleanup.policy"] == "compact"
    assert infos[f"{prefix}.stats"].config["cleanup.policy"] == "compact"
    ledger = infos[prompts_topic("train", prefix)]  # the prompt ledger: one ordered log, never aged out
    assert (ledger.partitions, ledger.config["cleanup.policy"]) == (1, "compact")


def test_changed_settings_are_applied_to_existing_topics(bootstrap_servers: str, prefix: str):
    """Configs follow the settings; a partition count only when raising it is asked for (issue 35)."""
    ensure_topics(bootstrap_servers, TopicSettings(prefix=prefix, steps_partitions=2).channel_specs("train"))
    changed = TopicSettings(prefix=prefix, steps_partitions=3, groups_retention_ms=999)
    assert ensure_topics(bootstrap_servers, changed.channel_specs("train")) == []
    infos = {i.name: i for i in describe_topics(bootstrap_servers, prefix=f"{prefix}.")}
    assert infos[steps_topic("train", prefix)].partitions == 2
    assert infos[groups_topic("train", prefix)].config["retention.ms"] == "999"
    ensure_topics(bootstrap_servers, changed.channel_specs("train"), grow_partitions=[steps_topic("train", prefix)])
    assert describe_topics(bootstrap_servers, names=[steps_topic("train", prefix)])[0].partitions == 3


def topics_table(lines: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The titles and, by topic, the cells of `trajbus topics`' table (columns stand two blanks apart)."""
    header, _rule, *rows = lines
    cells = [re.split(r"\s{2,}", row.strip()) for row in rows]
    return re.split(r"\s{2,}", header.strip()), {row[0]: row for row in cells}


def test_topics_cli_lists_partitions_retention_and_with_wide_offsets_and_configs(bootstrap_servers: str, prefix: str):
    """The default table fits 120 columns, whatever the terminal's width; --wide adds offsets and configs."""
    wide_terminal = {"COLUMNS": "1000"}  # a table drawn at the terminal's width would show here
    result = trajbus("topics", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--create",
                     "--channels", "train", env=wide_terminal)
    assert result.returncode == 0, result.stderr
    provisioned, *table = result.stdout.splitlines()
    assert provisioned == "provisioned 8 topics (8 new)"
    assert max(map(len, table)) <= 120, result.stdout
    titles, rows = topics_table(table)
    assert titles == ["topic", "partitions", "records", "cleanup", "retention", "max message"]
    assert set(rows) == {f"{prefix}.dlq", f"{prefix}.policy", f"{prefix}.stats", f"{prefix}.traces",
                         f"{prefix}.steps.train",
                         f"{prefix}.groups.train", f"{prefix}.chunks.train", f"{prefix}.prompts.train"}
    assert rows[f"{prefix}.steps.train"][1:] == ["8", "0", "delete", "7 d", "16 MiB"]
    assert rows[f"{prefix}.groups.train"][3:] == ["delete", "6 h / 1 GiB", "16 MiB"]
    assert rows[f"{prefix}.policy"][3:] == ["compact", "-", "-"]  # "-": the cluster's default applies

    wide = trajbus("topics", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--wide",
                   env=wide_terminal)
    assert wide.returncode == 0, wide.stderr
    titles, rows = topics_table(wide.stdout.splitlines())
    assert titles == ["topic", "partitions", "records", "cleanup", "retention", "max message", "end offsets",
                      "configs"]
    assert rows[f"{prefix}.steps.train"][6] == "0,0,0,0,0,0,0,0"
    assert rows[f"{prefix}.policy"][7] == "cleanup.policy=compact"


def test_topics_cli_refuses_a_bad_channel_with_exit_2(bootstrap_servers: str, prefix: str):
    result = trajbus("topics", "--bootstrap-servers", bootstrap_servers, "--channels", "Bad Channel")
    assert result.returncode == 2
    assert "channel" in result.stderr and "Bad Channel" in result.stderr


def test_topics_cli_shows_each_consumer_groups_lag(bootstrap_servers: str, prefix: str, start_worker):
    from trajbus.consumers import BatchConsumer
    from trajbus.pipelines.synthetic import make_groups
    from trajbus.streams.wire.topics import groups_topic, trainer_group_id
    from tests.helpers import fetch_groups, through_worker

    _, stream = make_groups(3, 2, 1, seed=2)
    through_worker(bootstrap_servers, prefix, start_worker, stream, n_rollouts=2)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:
        fetch_groups(trainer, 2, timeout=60)
        trainer.commit()
    result = trajbus("topics", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(trainer_group_id("train", prefix))]
    assert rows == [[trainer_group_id("train", prefix), groups_topic("train", prefix), "0", "2", "3", "1"]]
