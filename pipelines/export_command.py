"""``trajbus export``: a channel's groups as a dataset on disk (Parquet parts, or a Hugging Face dataset).

The flags are checked here, each problem one line and exit 2 (``UsageError``); the export itself is
``pipelines.export``. The window flags are ``trajbus replay``'s (``--from``/``--to``,
``--from-offset``/``--to-offset``), also spelt ``--start-time``/``--end-time`` and
``--start-offset``/``--end-offset``. ``trajbus.pipelines.cli`` adds the command to its parser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from trajbus.infra.kafka_config import add_connection_arguments
from trajbus.infra.terminal import ProgressLine
from trajbus.pipelines.reading_commands import UsageError

__all__ = ["add_export_parser", "cmd_export"]


def _number(args: argparse.Namespace, name: str, kind: type = float) -> Any:
    """A flag's value as ``kind`` (None when not given); else one usage line naming it."""
    text = getattr(args, name)
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise UsageError(f"--{name.replace('_', '-')}: expected {'an integer' if kind is int else 'a number'}, "
                         f"got {text!r}") from None
    if kind is float and value != value:
        raise UsageError(f"--{name.replace('_', '-')}: expected a number, got {text!r}")
    return value


def _tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from trajbus.infra.tokenizer_loading import load_tokenizer

    if not Path(path).is_dir():
        raise UsageError(f"--tokenizer {path}: no such folder (a Hugging Face tokenizer's folder)")
    try:
        return load_tokenizer(path)
    except Exception as exc:  # transformers raises many kinds; any is a path that cannot work
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--tokenizer {path}: no tokenizer loads from it ({reason})") from None


def settings_from_args(args: argparse.Namespace) -> Any:
    """The export's settings from the flags; ``UsageError`` for the first problem."""
    from trajbus.consumers.replay import ReplayError, parse_time
    from trajbus.pipelines.export import ExportSettings
    from trajbus.pipelines.export_filters import TrajectoryFilter, parse_versions

    if args.follow and (args.end or args.end_offset is not None):
        raise UsageError("--follow: keeps exporting as groups arrive; it takes no window end (--to, --to-offset)")
    if args.follow and args.format == "hf":
        raise UsageError("--follow writes Parquet parts as groups arrive; --format hf saves a dataset once, "
                         "at the end of a window (load the parts with datasets.load_dataset(\"parquet\", ...))")
    try:
        keep = TrajectoryFilter(min_reward=_number(args, "min_reward"), max_reward=_number(args, "max_reward"),
                                policy_versions=parse_versions(args.policy_version) if args.policy_version else None,
                                max_staleness=_number(args, "max_staleness", int),
                                current_version=_number(args, "current_version", int))
        start_time = parse_time(args.start) if args.start else None
        end_time = parse_time(args.end) if args.end else None
    except (ValueError, ReplayError) as exc:
        raise UsageError(str(exc)) from None
    return ExportSettings(
        channel=args.channel, output=Path(args.output), bootstrap_servers=args.bootstrap_servers, prefix=args.prefix,
        shape=args.shape, format=args.format, keep=keep, start_time=start_time, end_time=end_time,
        start_offset=_number(args, "start_offset", int), end_offset=_number(args, "end_offset", int),
        follow=args.follow, part_rows=args.part_rows, group_id=args.group_id, tokenizer=_tokenizer(args.tokenizer))


def cmd_export(args: argparse.Namespace) -> int:
    """Export, then one line saying what was written; a run stopped by Ctrl-C keeps every part written."""
    from trajbus.pipelines.export import ExportError, Exporter
    from trajbus.pipelines.export_parts import PartsMismatch
    from trajbus.pipelines.export_sft import SftUnavailable

    settings = settings_from_args(args)
    progress = ProgressLine(sys.stderr)
    exporter = Exporter(settings, progress)
    try:
        with progress:
            summary = exporter.run()
    except (ExportError, PartsMismatch, SftUnavailable) as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        summary, args.interrupted = exporter.summary, True
    state = summary.state
    offsets = ", ".join(f"{p}:{o}" for p, o in sorted(state.offsets.items())) or "none"
    print(f"exported {summary.rows_written} rows of {summary.groups_read} groups in {summary.parts_written} new "
          f"parts to {summary.directory} (in all {state.rows} rows, {state.parts} parts; {exporter.topic} "
          f"covered up to offsets {offsets})")
    return 130 if getattr(args, "interrupted", False) else 0


def add_export_parser(sub: argparse._SubParsersAction, add_prefix: Callable[[argparse.ArgumentParser], None]
                      ) -> None:
    """``trajbus export``; ``add_prefix``: the CLI's one ``--prefix`` declaration."""
    from trajbus.infra.arguments import positive_int

    export = sub.add_parser("export", help="a channel's groups as a dataset: Parquet parts or a Hugging Face dataset")
    add_connection_arguments(export)
    add_prefix(export)
    export.add_argument("--channel", required=True, help="the channel whose groups are exported")
    export.add_argument("--output", required=True, help="the folder of the dataset (parts: part-NNNNNN.parquet)")
    export.add_argument("--shape", choices=["rl", "sft"], default="rl",
                        help="rl: token ids, log-probs, versions per step; sft: the chat and its final reply")
    export.add_argument("--format", choices=["parquet", "hf"], default="parquet",
                        help="parquet: parts for datasets.load_dataset; hf: a dataset for datasets.load_from_disk")
    export.add_argument("--tokenizer", metavar="PATH", help="--shape sft: decodes token ids where steps carry no chat")
    window = export.add_argument_group("window (trajbus replay's; default: everything retained)")
    window.add_argument("--from", "--start-time", dest="start", help="start: unix seconds or ISO 8601 (UTC if no zone)")
    window.add_argument("--to", "--end-time", dest="end", help="end (exclusive)")
    window.add_argument("--from-offset", "--start-offset", dest="start_offset", help="start offset (1 partition)")
    window.add_argument("--to-offset", "--end-offset", dest="end_offset", help="end offset, exclusive")
    keep = export.add_argument_group("filters (per trajectory)")
    keep.add_argument("--min-reward", help="keep rewards >= this")
    keep.add_argument("--max-reward", help="keep rewards <= this")
    keep.add_argument("--policy-version", help="keep trajectories sampled only by these versions: 2,3 or 2-5")
    keep.add_argument("--max-staleness", metavar="K",
                      help="keep trajectories at most K versions behind --current-version (else the newest seen)")
    keep.add_argument("--current-version", help="the policy version staleness is measured against")
    export.add_argument("--follow", action="store_true",
                        help="keep exporting as groups arrive (Ctrl-C stops; a restart resumes from the parts)")
    export.add_argument("--part-rows", type=positive_int, default=4096,
                        help="a part is written once it holds this many rows; a group is never split "
                             "(default: %(default)s)")
    export.add_argument("--group-id", help="the consumer group whose commits show the export's lag "
                                           "(default: PREFIX.export.CHANNEL.<hash of --output>)")
    export.set_defaults(func=cmd_export)
