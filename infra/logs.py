"""How trajbus processes log: structured lines on stderr, without libraries' per-request chatter."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
CHATTY = ("httpx", "httpx2")
"""Loggers that write a line per HTTP call at INFO (httpx, and the openai client's httpx2)."""


def configure_logging(verbose: bool = False) -> None:
    """INFO (DEBUG when ``verbose``) on stderr; the chatty HTTP clients only from WARNING."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=FORMAT, stream=sys.stderr)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)


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
