"""Value types of command-line flags shared by every trajbus command (argparse ``type=``)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1; anything else is a usage error (exit code 2) naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _finite_float(text: str, lowest: float, zero_allowed: bool, expected: str) -> float:
    """A finite number at least ``lowest`` (above it unless ``zero_allowed``); else a usage error naming it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not (lowest <= value if zero_allowed else lowest < value) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0; anything else is a usage error (exit code 2) naming the value."""
    return _finite_float(text, 0.0, False, "a positive number")


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (0 turns the thing off); anything else is a usage error (exit code 2)."""
    return _finite_float(text, 0.0, True, "a number >= 0")


def seconds(text: str) -> float:
    """A finite number of seconds >= 0 (0: not at all)."""
    return _finite_float(text, 0.0, True, "a number of seconds >= 0")
