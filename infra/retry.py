"""The one retry policy for work that a broker's death, a leader election or a restart makes fail
for a while.

On a cluster these are routine: a partition has no leader for a few seconds, metadata
names a node that is gone, a request times out. What failed is done again, with
exponential backoff up to ``MAX_WAIT`` seconds between tries, until ``limit`` seconds
have passed; then the last error is raised and the component stops for a supervisor,
whose successor starts from the same place. Each retry is one warning line.
"""

from __future__ import annotations

import logging
from typing import Any

from tenacity import (AsyncRetrying, RetryCallState, Retrying, retry_if_exception_type, retry_if_not_exception_type,
                      stop_after_delay, wait_exponential)

MAX_WAIT = 5.0
FIRST_WAIT = 0.2


def _log_retry(logger: logging.Logger, what: str) -> Any:
    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        logger.warning("%s failed (%s: %s); retry %d in %.1fs", what, type(error).__name__, error,
                       state.attempt_number, state.next_action.sleep if state.next_action else 0.0)
    return before_sleep


Errors = tuple[type[BaseException], ...]


def _policy(limit: float, logger: logging.Logger, what: str, permanent: Errors, transient: Errors
            ) -> dict[str, Any]:
    return {"wait": wait_exponential(multiplier=FIRST_WAIT, max=MAX_WAIT), "stop": stop_after_delay(limit),
            "retry": retry_if_exception_type(transient) & retry_if_not_exception_type(permanent),
            "before_sleep": _log_retry(logger, what), "reraise": True}


def retrying_async(limit: float, logger: logging.Logger, what: str, permanent: Errors = (),
                   transient: Errors = (Exception,)) -> AsyncRetrying:
    """``async for attempt in retrying_async(...): with attempt: ...``: asyncio code, retried when the
    error is one of ``transient`` and not one of ``permanent`` (bad input, which no retry mends)."""
    return AsyncRetrying(**_policy(limit, logger, what, permanent, transient))


def retrying(limit: float, logger: logging.Logger, what: str, permanent: Errors = (),
             transient: Errors = (Exception,)) -> Retrying:
    """``for attempt in retrying(...): with attempt: ...``: blocking code, retried when the error is one
    of ``transient`` and not one of ``permanent``."""
    return Retrying(**_policy(limit, logger, what, permanent, transient))
