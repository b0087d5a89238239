"""What a worker's terminal shows: trajbus's lines, and of its libraries only what is news.

Faust's Kafka clients are aiokafka's, and aiokafka logs every attempt of a lost connection at
ERROR or WARNING: one broker stopped for 10 s was some fifteen lines, more at shutdown. Each of
these attempts is retried by aiokafka itself, and the outage has its own lines: ``infra.outage``
says once when it begins and once when it ends, the worker's periodic work says once that it
waits (``FailureStreak``). So the routine lines (``ROUTINE``, by logger and message template) are
DEBUG records (``RoutineClientLines``), shown with ``--faust-loglevel DEBUG``:

- ``aiokafka`` (its client): "Unable connect to ...", "Unable to request/update metadata ...":
  a connection attempt, every 0.1 to 1 s per broker;
- ``aiokafka.consumer.fetcher``: "Failed fetch messages/offsets from N": a fetch to a broker that
  is gone or no longer leads, retried after a backoff; "Attempt to fetch offsets ... failed": a
  leader moving;
- ``aiokafka.consumer.group_coordinator``: heartbeats, coordinator look-ups, commits and the
  leave request that fail while the coordinator is away or the group rebalances ("marking
  coordinator dead", "Will retry", "because it is rebalancing", "generation id is not current",
  "will rejoin"): each ends in a retry or a rejoin, which the assignment line reports;
- ``aiokafka.producer.sender``: a send to a broker that is gone, retried ("Cannot send",
  "Got error produce response ... retrying");
- ``mode.timers``: "Timer commit is overlapping (... runtime=34.5)": Faust's commit timer (every
  0.5 s) awaits each commit, which waits for the broker's answer through the whole outage
  (``ROUTINE_TIMERS``). Any other timer's overlap stays a WARNING: a blocked event loop.

Matching whole templates, never a logger, keeps every other line of these loggers at its level
(``--faust-loglevel``, WARNING by default): the fetcher's, coordinator's and sender's "Unexpected
error ...", a failed join, SyncGroup or partition listener, authorization failures; and whole
loggers stay as they are: ``aiokafka.cluster`` (a topic missing from metadata), ``aiokafka.conn``
(credentials sent in the clear, a broken connection object), ``aiokafka.consumer.consumer``, and
Faust's own (``faust``, ``mode``: a commit that crashes the consumer, a stalled recovery). Those
are errors no retry mends, or that put data at stake.
"""

from __future__ import annotations

import logging
import time
from logging import LogRecord

from confluent_kafka import KafkaException

from trajbus.infra.logs import FORMAT
from trajbus.infra.topics import UnservedRead

LIBRARIES = ("faust", "mode", "aiokafka", "kafka")
"""The worker's libraries: their loggers take ``--faust-loglevel``."""
QUIET = ("kafka",)
"""Libraries whose lines show only at ``--faust-loglevel DEBUG``. kafka-python serves only the group
look-up (``membership.group_size``), whose failure the worker's own line reports ("its size unknown"):
its connection errors when a broker goes away during a look-up, and its warning for every member that it
cannot decode the member's metadata (Faust's assignor writes its own), are not news."""

ROUTINE: dict[str, frozenset[str]] = {
    "aiokafka": frozenset({
        'Unable connect to "%s:%s": %s',
        'Unable to request metadata from "%s:%s": %s',
        "Unable to request metadata from node with id %s: %r",
        "Unable to update metadata from %s",
        "Unable connect to node with id %s: %s",
    }),
    "aiokafka.consumer.fetcher": frozenset({
        "Failed fetch messages from %s: %s",
        "Failed fetch offsets from %s: %s",
        "Attempt to fetch offsets for partition %s failed due to: %s",
    }),
    "aiokafka.consumer.group_coordinator": frozenset({
        "Error sending %s to node %s [%s] -- marking coordinator dead",
        "Marking the coordinator dead (node %s)for group %s.",
        "Group Coordinator Request failed: %s",
        "Heartbeat session expired - marking coordinator dead",
        "Heartbeat send request failed: %s. Will retry.",
        "Heartbeat failed for group %s: coordinator (node %s) is either not started or not valid",
        "Heartbeat failed for group %s because it is rebalancing",
        "Heartbeat failed for group %s: generation id is not  current.",
        "Heartbeat failed: local member_id was not recognized; resetting and re-joining group",
        "LeaveGroup request failed: %s",
        "OffsetCommit failed before join, ignoring: %s",
        "OffsetCommit failed for group %s due to group error (%s), will rejoin",
        "Failed to commit on finallization: %s",
    }),
    "aiokafka.producer.sender": frozenset({
        "Cannot send %r to %s: %r",
        "Could not send %r: %r",
        "Got error produce response: %s",
        "Got error produce response on topic-partition %s, retrying. Error: %s",
    }),
}
"""Per logger, the message templates of a routine attempt (``record.msg``, before its arguments)."""

OVERLAPPING = "Timer %s is overlapping (interval=%r runtime=%r)"
"""``mode.timers``' line for a timer whose run outlasted its interval."""
ROUTINE_TIMERS = frozenset({"commit"})
"""Faust's timers whose run waits on the broker (the consumer's commit): their overlap is an outage's."""


def routine(record: LogRecord) -> bool:
    """Whether ``record`` is a client's routine attempt (``ROUTINE``, or a broker-bound timer's overlap)."""
    if record.name == "mode.timers" and record.msg == OVERLAPPING:
        return bool(record.args) and record.args[0] in ROUTINE_TIMERS
    return record.msg in ROUTINE.get(record.name, ())


class RoutineClientLines(logging.Filter):
    """A routine client line (``ROUTINE``) becomes a DEBUG record, shown only where the libraries'
    level (``--faust-loglevel``) is DEBUG."""

    def __init__(self, level: str | int = logging.WARNING) -> None:
        super().__init__()
        self.level = logging.getLevelNamesMapping()[level.upper()] if isinstance(level, str) else level

    def filter(self, record: LogRecord) -> bool:
        if not routine(record):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return self.level <= logging.DEBUG


def logging_config(library_level: str, level: int = logging.INFO) -> dict:
    """trajbus's structured lines from ``level`` (INFO; DEBUG under ``trajbus -v``); Faust and its
    clients at ``library_level``, their routine attempts at DEBUG; a client's repeated line once a minute."""
    library_level = library_level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"line": {"format": FORMAT}},
        "filters": {"repeats": {"()": "trajbus.infra.logs.RepeatFilter"},
                    "routine": {"()": f"{__name__}.RoutineClientLines", "level": library_level}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "line",
                                "filters": ["routine", "repeats"]}},
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {name: {"level": "CRITICAL" if name in QUIET and library_level != "DEBUG" else library_level}
                    for name in LIBRARIES},
    }


def lost_kafka(exc: BaseException | None) -> bool:
    """Whether a failure comes from a lost Kafka connection (its cause chain holds a client error)."""
    from aiokafka.errors import KafkaError

    while exc is not None:
        if isinstance(exc, (KafkaError, KafkaException, ConnectionError, UnservedRead)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class FailureStreak:
    """The failures of a job repeated every few seconds while Kafka is away, told once per streak.

    The first failure is one WARNING line (what waits, and why; its traceback at DEBUG), the
    next ones DEBUG; a success ends the streak with one INFO line. A failure that is not Kafka's
    (``lost_kafka``) is a bug: an ERROR with its traceback, every time."""

    def __init__(self, what: str, logger: logging.Logger, clock=time.monotonic) -> None:
        self.what, self.log, self.clock = what, logger, clock
        self.since: float | None = None
        self.failures = 0

    def failed(self, exc: BaseException) -> None:
        if not lost_kafka(exc):
            self.log.error("%s failed; trying again", self.what, exc_info=exc)
            return
        self.failures += 1
        if self.since is None:
            self.since = self.clock()
            self.log.warning("%s waits for Kafka (%s); retrying until it answers", self.what, _short(exc))
        self.log.debug("%s failed (%d in a row)", self.what, self.failures, exc_info=exc)

    def succeeded(self) -> None:
        if self.since is not None:
            self.log.info("%s resumed after %.0fs (%d failed tries)", self.what, self.clock() - self.since,
                          self.failures)
        self.since, self.failures = None, 0


def _short(exc: BaseException) -> str:
    """An exception in a few words: a Kafka error's own text, not its repr."""
    if isinstance(exc, KafkaException) and exc.args and hasattr(exc.args[0], "str"):
        return exc.args[0].str()
    return f"{type(exc).__name__}: {exc}"
