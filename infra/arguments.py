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


def positive_float(text: str) -> float:
    """A finite number > 0; anything else is a usage error (exit code 2) naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (0 turns the thing off); anything else is a usage error (exit code 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value
