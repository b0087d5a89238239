"""What a command writes for a person to watch: a progress line on a terminal only, and a quiet end when
the reader of its output goes away (``trajbus tail ... | head -1``).

A progress line is redrawn in place (``\\r``) and erased (``\\x1b[2K``) before anything else is printed, so
results never run into it; piped or captured, a ``\\r`` line is noise in a log, so none is drawn at all.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO, Callable

__all__ = ["ProgressLine", "SIGPIPE_EXIT", "quiet_on_broken_pipe"]

ERASE = "\r\x1b[2K"
"""Back to the start of the line and erase it (ANSI EL 2): a shorter line leaves no tail of a longer one."""

SIGPIPE_EXIT = 128 + 13
"""The exit code of a process that a closed pipe ended: what the shell reports for ``seq 1e9 | head -1``."""


class ProgressLine:
    """One line of progress on ``stream`` (stderr), drawn only when it is a terminal, at most every
    ``interval`` seconds; ``print`` writes a result above it, and leaving the ``with`` erases it."""

    def __init__(self, stream: IO[str] | None = None, interval: float = 0.5) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.enabled = _is_terminal(self.stream)
        self._text = ""
        """The line on screen now ("" when none is)."""
        self._drawn_at = float("-inf")

    def update(self, text: str, final: bool = False) -> None:
        """Show ``text`` instead of the line on screen; skipped within ``interval`` of the last draw unless
        ``final`` (the last count must be seen)."""
        if not self.enabled or (not final and time.monotonic() - self._drawn_at < self.interval):
            return
        self._drawn_at = time.monotonic()
        self._draw(text)

    def clear(self) -> None:
        """Erase the line, so the next thing printed starts at the left edge of an empty line."""
        if self._text:
            self._text = ""
            self._write(ERASE)

    def print(self, *values: object, file: IO[str] | None = None) -> None:
        """``print`` a result (to stdout), erasing the progress line first and drawing it again below."""
        shown = self._text
        self.clear()
        print(*values, file=file if file is not None else sys.stdout, flush=bool(shown))  # out before the redraw
        if shown:
            self._draw(shown)

    def _draw(self, text: str) -> None:
        self._text = text
        self._write(ERASE + text)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def __enter__(self) -> "ProgressLine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def quiet_on_broken_pipe(run: Callable[[], int]) -> int:
    """``run()``, and its buffered output flushed; when the reader closed the pipe (``| head``), no
    traceback but exit ``SIGPIPE_EXIT``, as a command that SIGPIPE ends. Python's documented recipe
    (library/signal, "Note on SIGPIPE"): devnull takes stdout's place, so the interpreter's last
    flush at exit finds nothing to complain about."""
    try:
        try:
            return run()
        finally:
            sys.stdout.flush()  # also on the way out of a SystemExit (``--help``)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return SIGPIPE_EXIT
