"""The commands that read what the topics hold: ``tail`` (a topic live), ``replay`` (a channel's history) and
``trace`` (one trajectory's timeline). ``trajbus.pipelines.cli`` adds them to its parser."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from trajbus.infra.arguments import positive_int
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.kafka_config import add_connection_arguments
from trajbus.infra.terminal import ProgressLine
from trajbus.pipelines.tables import print_table


class UsageError(Exception):
    """Input the user must fix; printed as one line, exit code 2."""


# -- tail -----------------------------------------------------------------------

def cmd_tail(args: argparse.Namespace) -> int:
    from trajbus.consumers.tail import UnknownTopic, tail

    try:
        tail(resolve_bootstrap_servers(args.bootstrap_servers), args.topic, from_beginning=args.from_beginning,
             max_records=args.max, as_json=args.json)
    except UnknownTopic as exc:
        raise UsageError(str(exc)) from None
    return 0


# -- replay ---------------------------------------------------------------------

def _versions(text: str) -> set[int]:
    try:
        return {int(v) for v in text.split(",") if v.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_replay(args: argparse.Namespace) -> int:
    """The window's groups listed, or re-emitted ``--into`` a channel; the count of records read is a
    progress line on stderr when it is a terminal, erased before each line printed."""
    from trajbus.consumers.replay import Replay, ReplayError, parse_time

    if args.step is not None:
        return _replay_step(args)
    progress = ProgressLine(sys.stderr)
    try:
        replay = Replay(args.channel, args.bootstrap_servers, prefix=args.prefix, source=args.source,
                        start_time=parse_time(args.start) if args.start else None,
                        end_time=parse_time(args.end) if args.end else None,
                        start_offset=args.start_offset, end_offset=args.end_offset,
                        policy_versions=args.policy_versions, max_groups_per_s=args.max_groups_per_s,
                        progress=progress)
        if args.source == "steps" and not args.into:
            raise ReplayError("into: replay from the steps topic re-assembles groups; name a channel with --into")
    except ReplayError as exc:
        raise UsageError(str(exc)) from None
    with replay, progress:
        if args.into:
            try:
                count = replay.into_channel(args.into, n_rollouts=args.n_rollouts)
            except ReplayError as exc:
                raise UsageError(str(exc)) from None
            progress.print(f"replayed {count} records of {replay.topic} into channel {args.into!r}")
            return 0
        count = 0
        for group in replay.groups():
            versions = sorted({s.policy_version for s in group.steps})
            progress.print(f"{group.prompt_uid}  trajectories={len(group.trajectory_uids)} "
                           f"steps={len(group.steps)} versions={versions} status={group.status}")
            count += 1
        progress.print(f"{count} groups in the window")
    return 0


def _replay_step(args: argparse.Namespace) -> int:
    """``replay --step N``: the groups trainer step N trained, in its order, from the trained log."""
    from trajbus.consumers.step_batch import StepBatchError, StepBatches

    try:
        with StepBatches(args.channel, args.bootstrap_servers, args.prefix, args.run) as batches:
            record = batches.record(args.step)
            groups = batches.ready_groups(args.step)
    except StepBatchError as exc:
        raise UsageError(str(exc)) from None
    version = "" if record.policy_version is None else f", policy version {record.policy_version}"
    print(f"step {record.step} of run {record.run} ({record.trainer}{version}): {len(groups)} "
          f"group{'s' if len(groups) != 1 else ''}")
    for ref, group in zip(record.groups, groups):
        versions = sorted({s.policy_version for s in group.steps})
        print(f"{group.prompt_uid}  at={ref.partition}/{ref.offset} trajectories={len(group.trajectory_uids)} "
              f"steps={len(group.steps)} versions={versions}")
    return 0


# -- trace ----------------------------------------------------------------------

def cmd_trace(args: argparse.Namespace) -> int:
    """A trajectory's timeline (``consumers.trace_timeline``); none found is exit 1."""
    from trajbus.consumers.trace_timeline import COLUMNS, TrajectoryNotFound, cells, header, read_timeline

    servers = resolve_bootstrap_servers(args.bootstrap_servers)
    try:
        timeline = read_timeline(servers, args.trajectory_uid, prefix=args.prefix)
    except TrajectoryNotFound as exc:
        print(f"trajbus trace: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(timeline.as_json()))
    else:
        print(header(timeline))
        print_table(COLUMNS, cells(timeline.rows))
    return 0


def add_reading_parsers(sub: argparse._SubParsersAction, add_prefix: Callable[[argparse.ArgumentParser], None]
                        ) -> None:
    """``tail``, ``replay`` and ``trace``; ``add_prefix``: the CLI's one ``--prefix`` declaration."""
    tail = sub.add_parser("tail", help="print a topic's records live, readable (or --json)")
    tail.add_argument("topic", help="a full topic name, e.g. trajbus.steps.train")
    add_connection_arguments(tail)
    tail.add_argument("--from-beginning", action="store_true", help="start at the oldest retained record")
    tail.add_argument("--max", type=positive_int, help="stop after this many records")
    tail.add_argument("--json", action="store_true", help="one JSON object per record")
    tail.set_defaults(func=cmd_tail)

    replay = sub.add_parser("replay", help="replay a channel's history (a window, some policy versions)")
    add_connection_arguments(replay)
    add_prefix(replay)
    replay.add_argument("--channel", required=True, help="the channel whose history is replayed")
    replay.add_argument("--source", choices=["groups", "steps"], default="groups",
                        help="groups: a straight read; steps: re-assembled by a worker on --into's settings")
    replay.add_argument("--from", dest="start", help="window start: unix seconds or ISO 8601 (UTC if no zone)")
    replay.add_argument("--to", dest="end", help="window end (exclusive)")
    replay.add_argument("--from-offset", dest="start_offset", type=int, help="window start offset (1 partition)")
    replay.add_argument("--to-offset", dest="end_offset", type=int, help="window end offset, exclusive")
    replay.add_argument("--policy-versions", type=_versions, help="only groups of these versions, e.g. 2,3")
    replay.add_argument("--into", help="re-emit into this channel (else: list the groups)")
    replay.add_argument("--n-rollouts", type=positive_int, help="with --source steps: the group size to register")
    replay.add_argument("--max-groups-per-s", type=float, help="rate limit")
    replay.add_argument("--step", type=int, help="the groups trainer step N trained (the trained log)")
    replay.add_argument("--run", help="with --step: the run (default: the only one on the trained log)")
    replay.set_defaults(func=cmd_replay)

    trace = sub.add_parser("trace", help="a trajectory's timeline from the topics: its spans (or its records)")
    trace.add_argument("trajectory_uid", help="the trajectory's uid")
    add_connection_arguments(trace)
    add_prefix(trace)
    trace.add_argument("--json", action="store_true", help="the timeline as one JSON object")
    trace.set_defaults(func=cmd_trace)
