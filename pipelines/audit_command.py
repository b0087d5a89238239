"""``trajbus audit``: read a channel's ledger, trained log and groups topic, and print every prompt's fate
(``pipelines.audit``). Exit 0 when the run kept the exactly-once rule, 1 when it did not (each violation
named), 2 on bad input."""

from __future__ import annotations

import argparse
import json
from typing import Callable

from confluent_kafka import Consumer, TopicPartition

from trajbus.consumers.trained_log import TrainedLog, UnknownRun, choose_run
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.clients import reader
from trajbus.infra.kafka_config import add_connection_arguments
from trajbus.infra.topics import read_partition, watermarks
from trajbus.pipelines.audit import AuditReport, Place, audit
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.reading_commands import UsageError
from trajbus.pipelines.tables import print_table
from trajbus.streams.wire.ledger import LedgerView
from trajbus.streams.wire.topics import groups_topic, prompts_topic, unknown_channel_fix, validate_channel
from trajbus.streams.wire.trained import effective_steps

TIMEOUT = 30.0


def emitted_groups(consumer: Consumer, topic: str) -> tuple[dict[Place, str], dict[int, int]]:
    """Every group kept on the groups topic (place -> prompt_uid), and each partition's log start."""
    partitions = consumer.list_topics(topic, timeout=TIMEOUT).topics[topic].partitions
    places: dict[Place, str] = {}
    starts: dict[int, int] = {}
    for partition in sorted(partitions):
        start, end = watermarks(consumer, TopicPartition(topic, partition), TIMEOUT)
        starts[partition] = start
        for message in read_partition(consumer, topic, partition, start, end):
            places[(partition, message.offset())] = (message.key() or b"").decode()
    return places, starts


def gather(servers: str, channel: str, prefix: str, run: str | None, live: bool) -> AuditReport:
    """Read the three facts of a channel and audit them; an unknown channel is a ``UsageError``."""
    topic = groups_topic(channel, prefix)
    consumer = reader(servers, {"enable.partition.eof": True})
    try:
        names = consumer.list_topics(timeout=TIMEOUT).topics
        if topic not in names:
            raise UsageError(f"channel: {channel!r} has no topics under prefix {prefix!r}; "
                             f"{unknown_channel_fix(channel, prefix)}")
        emitted, log_start = emitted_groups(consumer, topic)
    finally:
        consumer.close()
    view = LedgerView()
    if prompts_topic(channel, prefix) in names:
        with PromptLedger(servers, channel, prefix, timeout=TIMEOUT) as ledger:
            ledger.refresh()
            view = ledger.view
    trained = TrainedLog(servers, channel, prefix, TIMEOUT)
    records = trained.read()
    try:
        chosen = choose_run(records, run, trained.topic)
    except UnknownRun as exc:
        raise UsageError(str(exc)) from None
    steps = effective_steps(record for record in records if record.run == chosen)
    return audit(channel, chosen, view, steps, emitted, log_start, live)


def print_report(report: AuditReport) -> None:
    print(f"audit of channel {report.channel!r}, run {report.run or '(no step recorded)'}: "
          f"{len(report.prompts)} prompt groups, {report.steps} trainer steps")
    print_table(["status", "prompt groups"], sorted(report.counts().items()))
    if report.violations:
        count = len(report.violations)
        print(f"{count} violation{'s' if count > 1 else ''}:")
        print_table(["prompt_uid", "violation", "where"],
                    [(fate.prompt_uid, fate.violation, fate.detail) for fate in report.violations])
    else:
        print("no violations: every prompt trained at most once, none skipped, none left unsettled")


def cmd_audit(args: argparse.Namespace) -> int:
    servers = resolve_bootstrap_servers(args.bootstrap_servers)
    try:
        channel = validate_channel(args.channel)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report = gather(servers, channel, args.prefix, args.run, args.live)
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        print_report(report)
    return 1 if report.violations else 0


def add_audit_parser(sub: argparse._SubParsersAction, add_prefix: Callable[[argparse.ArgumentParser], None]) -> None:
    audit_parser = sub.add_parser("audit", help="every prompt's fate in a run, and what broke exactly-once (exit 1)")
    add_connection_arguments(audit_parser)
    add_prefix(audit_parser)
    audit_parser.add_argument("--channel", default="train", help="the channel to audit")
    audit_parser.add_argument("--run", help="the run on the trained log (default: the only one there)")
    audit_parser.add_argument("--live", action="store_true",
                              help="the run goes on: prompts not settled yet are no violation")
    audit_parser.add_argument("--json", action="store_true", help="the whole report as one JSON object")
    audit_parser.set_defaults(func=cmd_audit)
