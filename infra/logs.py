"""How trajbus processes log: structured lines on stderr, without libraries' per-request chatter."""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
CHATTY = ("httpx", "httpx2")
"""Loggers that write a line per HTTP call at INFO (httpx, and the openai client's httpx2)."""


class RepeatFilter(logging.Filter):
    """A Kafka client's line that says what it said in the last ``window`` seconds is dropped.

    While a broker is down, aiokafka (the worker's Faust clients) reports every reconnect
    attempt (every 50 ms to 1 s); the state change is news, the repeats are not. Lines are
    compared with their numbers blanked (timings, ids, counters). (librdkafka's attempts are
    DEBUG records already; ``infra.outage`` tells its outage in two lines.)
    """

    CLIENT_LINE = re.compile(r"\[rdkafka#|^(aiokafka|kafka)\b")
    NUMBERS = re.compile(r"\d+")

    def __init__(self, window: float = 60.0) -> None:
        super().__init__()
        self.window = window
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not (self.CLIENT_LINE.search(message) or self.CLIENT_LINE.search(record.name)):
            return True
        key = f"{record.name}|{self.NUMBERS.sub('#', message)}"
        now = time.monotonic()
        if now - self._last.get(key, -self.window) < self.window:
            return False
        if len(self._last) > 1000:
            self._last.clear()
        self._last[key] = now
        return True


def configure_logging(verbose: bool = False) -> None:
    """INFO (DEBUG when ``verbose``) on stderr; the chatty HTTP clients only from WARNING; a Kafka
    client's repeated reconnect lines once a minute."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=FORMAT, stream=sys.stderr)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatFilter())


def log_to_file(path: Path) -> None:
    """Every log line of this process to ``path``; the terminal keeps only errors.
    For commands whose own output is the progress a person reads (the demo)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter(FORMAT))
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.setLevel(logging.ERROR)
    to_terminal.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(to_file)
    root.addHandler(to_terminal)
