"""The ``trajbus`` command line.

Every subcommand finds the broker the same way: ``--bootstrap-servers``, else
``TRAJBUS_BOOTSTRAP_SERVERS``, else the embedded broker of ``trajbus broker up``.
Bad input is one line on stderr and exit code 2; a failure at run time is exit 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable

from confluent_kafka import KafkaException

from trajbus.infra.arguments import positive_float, positive_int
from trajbus.infra.bootstrap import BrokerNotFound, resolve_bootstrap_servers
from trajbus.infra.clients import authentication_failure, explain
from trajbus.infra.declared import add_flag, add_flags, resolve, setting_value
from trajbus.infra.first_contact import CONNECT_TIMEOUT, first_contact
from trajbus.infra.group_lag import consumer_groups_lag
from trajbus.infra.kafka_broker import BrokerError
from trajbus.infra.kafka_config import KafkaConfigError, add_connection_arguments, apply_connection_arguments
from trajbus.infra.logs import configure_logging
from trajbus.infra.outage import KafkaUnreachable
from trajbus.infra.shared_settings import prefix_setting
from trajbus.infra.terminal import quiet_on_broken_pipe
from trajbus.infra.topics import ReplicationError, describe_topics, ensure_topics
from trajbus.pipelines import topics_table
from trajbus.pipelines.audit_command import add_audit_parser
from trajbus.pipelines.broker_command import BrokerUsageError, add_broker_parser
from trajbus.pipelines.export_command import add_export_parser
from trajbus.pipelines.reading_commands import UsageError, add_reading_parsers
from trajbus.pipelines.ready_command import add_ready_parser
from trajbus.pipelines.tables import print_table
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.topics import (DEFAULT_CHANNELS, DEFAULT_PREFIX, channel_setting, chunks_topic, groups_topic,
                                         steps_topic, validate_channel)
from trajbus.streams.worker.settings import ChannelSettings, WorkerSettings
from trajbus.streams.worker.settings import ENV_PREFIX as WORKER_ENV

EXIT_USAGE = 2




def _channels(text: str) -> tuple[str, ...]:
    try:
        return tuple(validate_channel(c.strip()) for c in text.split(",") if c.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _topic_settings(args: argparse.Namespace) -> TopicSettings:
    """The topic settings of the flags; a partition flag not given is TopicSettings' default."""
    counts = {name: getattr(args, name) for name in ("steps_partitions", "groups_partitions")
              if getattr(args, name) is not None}
    try:
        return TopicSettings(prefix=args.prefix, replication_factor=args.replication_factor,
                             min_insync_replicas=args.min_insync_replicas, **counts)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# -- topics ---------------------------------------------------------------------

def _raised_on_purpose(args: argparse.Namespace, settings: TopicSettings) -> list[str]:
    """The topics whose partition count the command line names: only those may be raised (a default is
    no request to change an existing topic's count; ``infra.topics``)."""
    kinds = ([steps_topic] if args.steps_partitions is not None else []) + \
        ([groups_topic, chunks_topic] if args.groups_partitions is not None else [])
    return [name(channel, settings.prefix) for name in kinds for channel in args.channels]


def _add_connect_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect-timeout", type=positive_float, default=CONNECT_TIMEOUT, metavar="SECONDS",
                        help="how long to wait for the cluster's first answer; past it (a wrong address) one line "
                             "naming the address, exit 1 (default: %(default)g)")


def cmd_topics(args: argparse.Namespace) -> int:
    servers = resolve_bootstrap_servers(args.bootstrap_servers)
    settings = _topic_settings(args)
    first_contact(servers, args.connect_timeout)
    if args.create:
        specs = settings.specs(args.channels)
        created = ensure_topics(servers, specs, grow_partitions=_raised_on_purpose(args, settings))
        print(f"provisioned {len(specs)} topics ({len(created)} new)")
    infos = describe_topics(servers, prefix=f"{settings.prefix}.")
    if not infos:
        print(f"no topics under prefix {settings.prefix!r} (create them with --create)")
        return 0
    print_table(topics_table.WIDE_COLUMNS if args.wide else topics_table.COLUMNS,
                topics_table.rows(infos, wide=args.wide))
    lags = consumer_groups_lag(servers, f"{settings.prefix}.")
    if lags:
        print()
        print_table(["consumer group", "topic", "partition", "committed", "end", "lag"],
                    [[g.group_id, g.topic, g.partition, g.committed, g.high, g.lag] for g in lags])
    return 0


# -- worker ---------------------------------------------------------------------

def cmd_worker(args: argparse.Namespace) -> int:
    from trajbus.streams.worker.process import PartitionMismatch, run_worker

    try:
        default = ChannelSettings(**resolve(ChannelSettings, args, WORKER_ENV))
        changes: dict[str, dict[str, object]] = {}
        for channel, name, value in args.channel_setting or []:
            changes.setdefault(channel, {})[name] = setting_value(ChannelSettings, name, value, "channel setting")
        overrides = {channel: default.replace(**change) for channel, change in changes.items()}
        settings = WorkerSettings(topics=_topic_settings(args), channels=args.channels, default=default,
                                  overrides=overrides, **resolve(WorkerSettings, args, WORKER_ENV))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        run_worker(settings, args.bootstrap_servers)
    except PartitionMismatch as exc:  # the user settles the count (README, "The stream worker")
        raise UsageError(str(exc)) from None
    return 0


# -- stats ----------------------------------------------------------------------

STATS_COLUMNS = [
    ("events[step]", "steps in"), ("trajectories_completed", "traj done"), ("groups[ready]", "ready"),
    ("groups[partial]", "partial"), ("groups[emitted]", "emitted"), ("pending_groups", "pending"),
    ("pending_trajectories", "pend traj"), ("queue_depth", "queue"), ("duplicate_events", "dups"),
    ("late_events", "late"), ("policy_version", "policy"), ("in_flight_groups", "gw in flight"),
    ("partitions_held", "partitions"),
]
WIDE_ONLY_STATS = {"pending_trajectories", "duplicate_events", "late_events"}
"""Columns of ``stats --wide`` only, so the default table fits 120 columns (a late event is counted on the
``dlq late=`` line too)."""


def cmd_stats(args: argparse.Namespace) -> int:
    from trajbus.streams.wire.stats import held_partitions, is_live, summarize
    from trajbus.streams.client.snapshots import read_snapshots

    servers = resolve_bootstrap_servers(args.bootstrap_servers)
    first_contact(servers, args.connect_timeout)
    started, deadline = time.time(), time.monotonic() + args.wait
    snapshots = read_snapshots(servers, args.prefix)
    while args.wait and time.monotonic() < deadline and not any(s["updated_at"] >= started for s in snapshots):
        time.sleep(0.5)  # a worker publishes every --stats-interval seconds: counts as of now, not as of then
        snapshots = read_snapshots(servers, args.prefix)
    summary = summarize(snapshots)
    now = time.time()
    live = sum(1 for snapshot in snapshots if is_live(snapshot, now))
    if args.json:
        import json

        print(json.dumps({"workers": len(snapshots), "live": live, "channels": summary,
                          "partitions": held_partitions(snapshots)}, indent=2, sort_keys=True))
        return 0
    if not summary:
        print(f"no worker statistics under prefix {args.prefix!r} yet (is `trajbus worker` running?)")
        return 0
    columns = [(key, title) for key, title in STATS_COLUMNS if args.wide or key not in WIDE_ONLY_STATS]
    print_table(["channel", *(title for _, title in columns)],
                [[channel, *(round(row.get(key, 0)) for key, _ in columns)]
                 for channel, row in sorted(summary.items())],
                title=f"workers: {live} live, {len(snapshots)} seen")
    for worker_id, held in sorted(held_partitions(snapshots).items()) if args.workers else ():
        print(f"{worker_id} holds " + ("; ".join(f"{channel} partitions {','.join(map(str, partitions))}"
                                                 for channel, partitions in sorted(held.items())) or "no partition"))
    for channel, row in sorted(summary.items()):
        drops = {k[len("groups_dropped["):-1]: v for k, v in row.items() if k.startswith("groups_dropped[")}
        dlq = {k[len("dlq_records["):-1]: v for k, v in row.items() if k.startswith("dlq_records[")}
        if drops or dlq:
            print(f"{channel}: dropped " + (", ".join(f"{k}={v:.0f}" for k, v in sorted(drops.items())) or "none")
                  + "; dlq " + (", ".join(f"{k}={v:.0f}" for k, v in sorted(dlq.items())) or "none"))
        buckets = row.get("staleness_le")
        if buckets:
            print(f"{channel}: staleness <= " + ", ".join(f"{le}: {n:.0f}" for le, n in buckets.items()))
    return 0


# -- gateway --------------------------------------------------------------------

def cmd_gateway(args: argparse.Namespace) -> int:
    from trajbus.gateway.config import settings_from_args
    from trajbus.gateway.server import serve

    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return serve(settings)


def cmd_inference_server(args: argparse.Namespace) -> int:
    from trajbus.infra.inference_server import ENV_PREFIX, InferenceServerSettings, serve

    try:
        settings = InferenceServerSettings(**resolve(InferenceServerSettings, args, ENV_PREFIX))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return serve(settings)


# -- demo -----------------------------------------------------------------------

def cmd_demo(args: argparse.Namespace) -> int:
    from trajbus.pipelines.demo import run_demo
    from trajbus.pipelines.demo_config import load_demo_config

    try:
        config = load_demo_config(args.config)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return run_demo(config, bootstrap_servers=args.bootstrap_servers)


# -- parser ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Topics:
    """What every topic command shares: ``--prefix`` (``infra.shared_settings``), so they name the same topics."""

    prefix: str = prefix_setting(DEFAULT_PREFIX)


def _add_prefix(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, _Topics, "prefix")


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    _add_prefix(parser)
    parser.add_argument("--steps-partitions", type=positive_int, default=None,
                        help=f"partitions of each steps topic (default: {TopicSettings.steps_partitions}); "
                             "`topics --create` raises an existing topic's count only when given")
    parser.add_argument("--groups-partitions", type=positive_int, default=None,
                        help=f"partitions of each groups topic (default: {TopicSettings.groups_partitions})")
    parser.add_argument("--replication-factor", type=positive_int, default=None,
                        help="replicas of every topic trajbus creates (default: the cluster's default.replication.factor)")
    parser.add_argument("--min-insync-replicas", type=positive_int, default=None,
                        help="min.insync.replicas of every topic trajbus creates (default: the cluster's)")
    parser.add_argument("--channels", type=_channels, default=DEFAULT_CHANNELS,
                        help="comma-separated channel names (default: train,val)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trajbus", description="The Kafka data plane of agentic RL.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    add_broker_parser(sub)

    topics = sub.add_parser("topics", help="list (and with --create, provision) trajbus topics")
    _add_common(topics)
    topics.add_argument("--create", action="store_true", help="provision the topics of --channels first")
    topics.add_argument("--wide", action="store_true",
                        help="also each partition's end offset and every config as set (lines past 120 columns)")
    _add_connect_timeout(topics)
    topics.set_defaults(func=cmd_topics)

    worker = sub.add_parser("worker", help="the Faust stream processor that assembles prompt groups")
    _add_common(worker)
    rules = worker.add_argument_group("channel rules (defaults for every channel)")
    add_flags(rules, ChannelSettings, WORKER_ENV)
    rules.add_argument("--channel-setting", type=channel_setting, action="append", metavar="CHANNEL.SETTING=VALUE",
                       help="override one rule for one channel, e.g. val.n_rollouts=1 (repeatable)")
    add_flags(worker, WorkerSettings, WORKER_ENV)
    worker.set_defaults(func=cmd_worker)

    stats = sub.add_parser("stats", help="statistics of the stream workers, per channel")
    add_connection_arguments(stats)
    _add_prefix(stats)
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.add_argument("--wide", action="store_true", help="also the columns pend traj, dups and late")
    stats.add_argument("--workers", action="store_true",
                       help="also one line per live worker: the steps partitions it holds (in --json: always)")
    stats.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                       help="wait up to SECONDS for a worker's snapshot taken after this command started")
    _add_connect_timeout(stats)
    stats.set_defaults(func=cmd_stats)

    gateway = sub.add_parser("gateway", help="the HTTP gateway of agents (OpenAI-compatible, token-exact)")
    from trajbus.gateway.config import add_gateway_arguments

    add_gateway_arguments(gateway)
    gateway.set_defaults(func=cmd_gateway)

    serve_model = sub.add_parser("inference-server",
                                 help="a local vLLM-compatible server of the tiny chat model (tests, demo)")
    from trajbus.infra.inference_server import ENV_PREFIX as INFERENCE_ENV, InferenceServerSettings

    add_flags(serve_model, InferenceServerSettings, INFERENCE_ENV)
    serve_model.set_defaults(func=cmd_inference_server)

    add_reading_parsers(sub, _add_prefix)
    add_audit_parser(sub, _add_prefix)
    add_ready_parser(sub)
    add_export_parser(sub, _add_prefix)

    demo = sub.add_parser("demo", help="the whole system end to end: agents, gateway, worker, a GRPO trainer")
    add_connection_arguments(demo, "use this cluster instead of a throw-away embedded broker")
    demo.add_argument("--config", help="the demo's YAML file (default: pipelines/configs/demo.yaml)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; a reader that closed the pipe early (``| head``) ends it quietly."""
    return quiet_on_broken_pipe(lambda: _run(argv))


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        apply_connection_arguments(args)
        return func(args)
    except (UsageError, BrokerUsageError, KafkaConfigError, ReplicationError) as exc:
        print(f"trajbus {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (BrokerNotFound, BrokerError, KafkaUnreachable) as exc:
        print(f"trajbus {args.command}: {exc}", file=sys.stderr)
        return 1
    except KafkaException as exc:  # credentials the broker refused are bad input: exit 2
        servers = getattr(args, "bootstrap_servers", None)
        print(f"trajbus {args.command}: {explain(exc, servers)}", file=sys.stderr)
        return EXIT_USAGE if authentication_failure() else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
