"""When an inference backend is in service: its health probe judged beside its recent answers.

A busy engine is not a dead one (issue 31). An engine under load may answer
``GET /health`` after the gateway's probe gave up, or the gateway's own event
loop, saturated, may read the answer too late, while every call still gets its
answer. Taking such a backend out on one slow probe turned a loaded benchmark
into nothing but 503s. So a probe that gets no answer in time is evidence only
when the backend has shown no other sign of life lately: a backend that passed
a probe or answered a call (HTTP 200) within the last ``window`` seconds stays
in service. Definite failures still take it out at once:

- a probe refused, broken or answered with another status than 200: the
  process is gone or says it is unwell. Its earlier answers no longer count:
  only a passing probe, or an answer received after this, puts it back;
- a call refused a connection (``BackendPool._refused``): out at once, as before;
  the next probe decides (a slow one with recent answers puts it back);
- a call whose new connection the engine closed before answering: out only when it
  has shown no other sign of life lately. An engine behind on its event loop closes
  connections it cannot serve in time (at thousands of calls in flight); taking the
  only engine out for that failed every other call in flight until the next probe.

Calls answered with an error (5xx, a broken stream) are counted by the pool but
take no backend out while its probe passes, as before; they are no sign of life
either, so a backend whose calls fail and whose probe is slow goes out once its
last answer is ``window`` old. A backend never seen healthy is waited for: only
a passing probe brings it in.

``Liveness`` is the rule alone, without I/O or clock: the pool passes ``now``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

NEVER = float("-inf")
"""``alive_at`` of a backend with no answer that counts."""

ALIVE_WINDOW = 15.0
"""Seconds a backend's last answer keeps it in service while its probe gets no answer in time (the pool
widens it to two probe rounds where its probes are sparser)."""


class ProbeResult(enum.Enum):
    """What one health probe found."""

    PASSED = "passed"
    """``/health`` answered 200."""
    SLOW = "slow"
    """No answer within the probe's timeout: busy, or hung; the backend's answers tell which."""
    FAILED = "failed"
    """Refused, broken off, or answered with another status: the process is gone or unwell."""


class Change(enum.Enum):
    """How a backend's service changed, for the pool's log."""

    READY = "ready"
    """First seen healthy (start-up, not a return)."""
    BACK_IN = "back in"
    TAKEN_OUT = "taken out"
    KEPT_IN = "kept in"
    """Its probe got no answer but it answered lately: first slow probe of a spell only."""


@dataclass(slots=True)
class Liveness:
    """One backend's service state; events in, the change (if any) out."""

    window: float = ALIVE_WINDOW
    in_service: bool = False
    seen: bool = False
    """Whether a probe ever passed: a backend not yet up at start is waited for, not "taken out"."""
    alive_at: float = NEVER
    """When it last passed a probe or answered a call (monotonic seconds)."""
    slow: bool = False
    """Whether its last probe got no answer in time."""

    def answered(self, now: float) -> None:
        """A call got its answer (HTTP 200). The gateway's hot path: one store."""
        self.alive_at = now

    def probed(self, probe: ProbeResult, now: float) -> Change | None:
        """Apply one probe's outcome."""
        was_in = self.in_service
        if probe is ProbeResult.PASSED:
            self.alive_at, self.slow, self.in_service = now, False, True
            if not self.seen:
                self.seen = True
                return Change.READY
            return None if was_in else Change.BACK_IN
        if probe is ProbeResult.FAILED:
            self.alive_at, self.slow, self.in_service = NEVER, False, False
            return Change.TAKEN_OUT if was_in else None
        first_slow, self.slow = not self.slow, True
        self.in_service = self.seen and now - self.alive_at <= self.window
        if was_in != self.in_service:
            return Change.BACK_IN if self.in_service else Change.TAKEN_OUT
        return Change.KEPT_IN if self.in_service and first_slow else None

    def refused(self) -> Change | None:
        """A call got no answer at all (refused, reset, no connection in time): out until the next probe."""
        was_in, self.in_service = self.in_service, False
        return Change.TAKEN_OUT if was_in else None

    def lost(self, now: float) -> Change | None:
        """A call's connection was closed before any answer (not refused): out unless it answered lately."""
        was_in = self.in_service
        self.in_service = was_in and now - self.alive_at <= self.window
        return Change.TAKEN_OUT if was_in and not self.in_service else None

    def answered_ago(self, now: float) -> float:
        """Seconds since its last answer (``inf`` if none counts)."""
        return now - self.alive_at
