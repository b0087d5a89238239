"""``trajbus ready URL``: wait until a gateway answers ``/ready``, saying why it is not ready yet.

A readiness wait by ``curl --retry`` waits in silence and ends in a bare exit code; this one prints the
gateway's own reason (``/ready``'s 503 body) each time it changes, and names it once more if the wait
runs out. ``trajbus.pipelines.cli`` adds it to its parser.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import httpx

from trajbus.infra.arguments import positive_float
from trajbus.pipelines.reading_commands import UsageError

POLL_SECONDS = 1.0
EXIT_NOT_READY = 1


def why_not_ready(url: str, timeout: float = 5.0) -> str | None:
    """None when ``{url}/ready`` answers 2xx; else the reason, in the gateway's words where it gave some."""
    try:
        answer = httpx.get(f"{url.rstrip('/')}/ready", timeout=timeout)
    except httpx.ConnectError:
        return "not listening yet (connection refused)"
    except httpx.HTTPError as exc:
        return f"no answer ({type(exc).__name__})"
    if answer.is_success:
        return None
    try:
        reason = answer.json().get("reason")
    except ValueError:
        reason = None
    return f"{answer.status_code}: {reason or answer.text[:200] or answer.reason_phrase}"


def wait_ready(url: str, timeout: float, say: Callable[[str], None], poll: float = POLL_SECONDS) -> str | None:
    """Poll until ready (None) or ``timeout`` seconds passed (the last reason); each new reason is said once."""
    deadline, said = time.monotonic() + timeout, None
    while True:
        reason = why_not_ready(url)
        if reason is None:
            return None
        if reason != said:
            say(f"waiting for {url}: {reason}")
            said = reason
        if time.monotonic() + poll > deadline:
            return reason
        time.sleep(poll)


def cmd_ready(args: argparse.Namespace) -> int:
    if not args.url.startswith(("http://", "https://")):
        raise UsageError(f"url: expected http://HOST:PORT, got {args.url!r}")
    reason = wait_ready(args.url, args.timeout, lambda line: print(line, file=sys.stderr, flush=True))
    if reason is not None:
        print(f"trajbus ready: {args.url} not ready after {args.timeout:g} s: {reason}", file=sys.stderr)
        return EXIT_NOT_READY
    print(f"{args.url} is ready")
    return 0


def add_ready_parser(sub: argparse._SubParsersAction) -> None:
    ready = sub.add_parser("ready", help="wait until a gateway is ready, saying why it is not yet")
    ready.add_argument("url", help="the gateway, e.g. http://127.0.0.1:8100")
    ready.add_argument("--timeout", type=positive_float, default=120.0, metavar="SECONDS",
                       help="how long to wait; past it one line with the last reason, exit 1 (default: %(default)g)")
    ready.set_defaults(func=cmd_ready)
