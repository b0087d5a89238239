"""The one retry policy for work that a broker's death, a leader election or a restart makes fail
for a while, and for work a server refuses with the time to ask again.

On a cluster these are routine: a partition has no leader for a few seconds, metadata
names a node that is gone, a request times out. What failed is done again, with
exponential backoff from ``first_wait`` up to ``MAX_WAIT`` seconds between tries, until
``limit`` seconds have passed (or ``stop`` is set); then the last error is raised and the
component stops for a supervisor, whose successor starts from the same place. Each retry
is one log line (a warning unless the caller says it is routine).

A refusal that says when to ask again (HTTP 429 with ``Retry-After``: the gateway pacing
an agent) is ``RetryLater``: ``retrying_when_told`` waits as told, for as long as it takes,
until its ``stopped`` event is set.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tenacity import (AsyncRetrying, RetryCallState, Retrying, retry_if_exception_type, retry_if_not_exception_type,
                      stop_after_delay, stop_when_event_set, wait_exponential)

MAX_WAIT = 5.0
FIRST_WAIT = 0.2


def _log_retry(logger: logging.Logger, what: str, level: int) -> Any:
    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        logger.log(level, "%s failed (%s: %s); retry %d in %.1fs", what, type(error).__name__, error,
                   state.attempt_number, state.next_action.sleep if state.next_action else 0.0)
    return before_sleep


Errors = tuple[type[BaseException], ...]


def _policy(limit: float, logger: logging.Logger, what: str, permanent: Errors, transient: Errors, level: int,
            first_wait: float, stop: threading.Event | None) -> dict[str, Any]:
    policy: dict[str, Any] = {
        "wait": wait_exponential(multiplier=first_wait, max=MAX_WAIT), "stop": stop_after_delay(limit),
        "retry": retry_if_exception_type(transient) & retry_if_not_exception_type(permanent),
        "before_sleep": _log_retry(logger, what, level), "reraise": True}
    if stop is not None:  # a wait ends early when the caller stops, and no try follows
        policy.update(stop=policy["stop"] | stop_when_event_set(stop), sleep=_stoppable_sleep(stop))
    return policy


def _stoppable_sleep(stop: threading.Event) -> Any:
    def sleep(seconds: float) -> None:
        if stop.wait(seconds):
            raise Stopped()
    return sleep


class Stopped(Exception):
    """The caller's ``stop`` event was set while a retry waited."""


def retrying_async(limit: float, logger: logging.Logger, what: str, permanent: Errors = (),
                   transient: Errors = (Exception,)) -> AsyncRetrying:
    """``async for attempt in retrying_async(...): with attempt: ...``: asyncio code, retried when the
    error is one of ``transient`` and not one of ``permanent`` (bad input, which no retry mends)."""
    return AsyncRetrying(**_policy(limit, logger, what, permanent, transient, logging.WARNING, FIRST_WAIT, None))


def retrying(limit: float, logger: logging.Logger, what: str, permanent: Errors = (),
             transient: Errors = (Exception,), level: int = logging.WARNING, first_wait: float = FIRST_WAIT,
             stop: threading.Event | None = None) -> Retrying:
    """``for attempt in retrying(...): with attempt: ...``: blocking code, retried when the error is one
    of ``transient`` and not one of ``permanent``. ``level``: of the retry lines (DEBUG where a retry is
    routine, such as a new partition's leader election); ``stop``: an event that ends the retries, a
    wait under way raising ``Stopped``."""
    return Retrying(**_policy(limit, logger, what, permanent, transient, level, first_wait, stop))


class RetryLater(Exception):
    """A refusal that says how many seconds to wait before asking again (HTTP 429's ``Retry-After``)."""

    def __init__(self, message: str, after: float) -> None:
        super().__init__(message)
        self.after = after


def retrying_when_told(stopped: threading.Event) -> Retrying:
    """``for attempt in retrying_when_told(stopped): with attempt: ...``: work refused with ``RetryLater``
    is asked again after the wait the refusal names, for as long as it takes; once ``stopped`` is set no
    try follows, and the last refusal is raised (at once, when it is set during a wait)."""
    refusals: list[BaseException] = []

    def note(state: RetryCallState) -> None:
        refusals[:] = [state.outcome.exception()] if state.outcome else []

    def sleep(seconds: float) -> None:
        if stopped.wait(seconds):
            raise refusals[0]

    def told(state: RetryCallState) -> float:
        refusal = state.outcome.exception() if state.outcome else None
        return refusal.after if isinstance(refusal, RetryLater) else FIRST_WAIT

    return Retrying(retry=retry_if_exception_type(RetryLater), wait=told, stop=stop_when_event_set(stopped),
                    before_sleep=note, sleep=sleep, reraise=True)
