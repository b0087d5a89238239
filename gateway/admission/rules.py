"""Admission control: a new trajectory starts only while the trainer keeps up.

Generating a rollout the trainer will never use wastes the GPU time it took:
the worker's queue bound deletes the oldest ready groups and its staleness rule
drops old ones. So the gateway holds new trajectories back instead. A new
trajectory (black-box ``init_trajectory``; white-box: the first ``/generate``
of a trajectory uid) is admitted only while, on its channel,

- the **backlog** -- ready groups the trainer's consumer group has not committed,
  plus the groups that admitted, unfinished trajectories will make (this
  gateway's and, from their snapshots on Kafka, every other gateway's) -- is
  under ``max_backlog_groups``; a further rollout of a group already in flight
  here adds no group and is not held back by it;
- the policy version it would start at is at most ``max_staleness`` versions
  behind the trainer's (``streams.client.policy``: a declared version, else the one the
  engines serve).

Otherwise it is answered 429 with ``Retry-After``, or held (``?wait=SECONDS``)
until admitted. An admitted trajectory is never refused again: pacing never
cuts a rollout. Its group stops counting as in flight ``FINISHING_SECONDS``
after its last admitted trajectory finished (by then the worker has emitted the
group and the lag counts it as ready: counting it in neither would admit one
group too many), or after ``idle_timeout`` seconds without a call (an agent
that died: the gateway abandons it).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from trajbus.gateway.errors import GatewayError
from trajbus.gateway.metrics import GatewayMetrics

BACKLOG_FULL, POLICY_TOO_STALE, BACKLOG_UNKNOWN = "backlog_full", "policy_too_stale", "backlog_unknown"
RETRY_SECONDS = 2
"""What a 429 tells the agent to wait: about two refreshes of the signals."""
SETTINGS = ("max_backlog_groups", "max_staleness")
FINISHING_SECONDS = 3.0
"""How long a finished group still counts as in flight: the worker's assembly plus a refresh of the lag."""


@dataclass(frozen=True)
class AdmissionRules:
    """One channel's limits; None: that limit is off."""

    max_backlog_groups: int | None = None
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        for name in SETTINGS:
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")

    @property
    def active(self) -> bool:
        return self.max_backlog_groups is not None or self.max_staleness is not None


@dataclass(frozen=True)
class Backlog:
    """A channel's backlog in groups, as one gateway sees it."""

    ready: int
    """Ready groups the trainer's consumer group has not committed."""
    in_flight_here: int
    in_flight_elsewhere: int
    """Groups other live gateways announced as in flight."""

    @property
    def total(self) -> int:
        return self.ready + self.in_flight_here + self.in_flight_elsewhere


def refusal(rules: AdmissionRules, backlog: Backlog | None, new_group: bool, start_version: int | None,
            trainer_version: int | None) -> str | None:
    """Why a new trajectory may not start now (a reason code), or None: admit it."""
    if rules.max_staleness is not None and start_version is not None and trainer_version is not None \
            and trainer_version - start_version > rules.max_staleness:
        return POLICY_TOO_STALE
    if rules.max_backlog_groups is not None and new_group:
        if backlog is None:
            return BACKLOG_UNKNOWN
        if backlog.total >= rules.max_backlog_groups:
            return BACKLOG_FULL
    return None


@dataclass
class Admitted:
    channel: str
    prompt_uid: str
    last_seen: float


class Admission:
    """Decides, holds and counts admissions; the trajectories it admitted are its in-flight count."""

    def __init__(self, default: AdmissionRules, overrides: dict[str, AdmissionRules], idle_timeout: float,
                 metrics: GatewayMetrics) -> None:
        self.default, self.overrides = default, overrides
        self.idle_timeout = idle_timeout
        self.metrics = metrics
        self.admitted: dict[str, Admitted] = {}
        self.finishing: dict[tuple[str, str], float] = {}
        """(channel, prompt_uid) of groups whose trajectories all finished -> when the last one did."""
        self.ready: Callable[[str], int | None] = lambda channel: None
        """Ready groups of a channel (``BacklogMonitor.ready``, once Kafka is connected)."""
        self.elsewhere: Callable[[str], set[str]] = lambda channel: set()
        """Prompt groups of a channel in flight at the other live gateways (``BacklogMonitor.elsewhere``)."""
        self._changed = asyncio.Event()

    def rules(self, channel: str) -> AdmissionRules:
        return self.overrides.get(channel, self.default)

    @property
    def active(self) -> bool:
        return self.default.active or any(rules.active for rules in self.overrides.values())

    # -- in flight -------------------------------------------------------------------
    def in_flight(self) -> dict[str, set[str]]:
        """Per channel, the prompt groups admitted trajectories are still making (not those abandoned).
        Only reads: safe from the thread that publishes the counts."""
        now = time.time()
        groups: dict[str, set[str]] = {}
        for entry in list(self.admitted.values()):
            if entry.last_seen >= now - self.idle_timeout:
                groups.setdefault(entry.channel, set()).add(entry.prompt_uid)
        for (channel, prompt_uid), finished in list(self.finishing.items()):
            if finished >= now - FINISHING_SECONDS:
                groups.setdefault(channel, set()).add(prompt_uid)
        return groups

    def forget_abandoned(self) -> None:
        """Drop abandoned trajectories and groups finished long enough ago (on the event loop only)."""
        now = time.time()
        for uid in [uid for uid, entry in self.admitted.items() if entry.last_seen < now - self.idle_timeout]:
            del self.admitted[uid]
        for key in [key for key, finished in self.finishing.items() if finished < now - FINISHING_SECONDS]:
            del self.finishing[key]

    def backlog(self, channel: str, in_flight_here: set[str] | None = None) -> Backlog | None:
        """The channel's backlog; ``in_flight_here``: its groups in flight, when the caller has them already."""
        ready = self.ready(channel)
        if ready is None:
            return None
        here = self.in_flight().get(channel, set()) if in_flight_here is None else in_flight_here
        return Backlog(ready, len(here), len(self.elsewhere(channel) - here))

    def add(self, trajectory_uid: str, channel: str, prompt_uid: str, last_seen: float | None = None) -> None:
        self.admitted[trajectory_uid] = Admitted(channel, prompt_uid, last_seen or time.time())

    def touch(self, trajectory_uid: str) -> None:
        entry = self.admitted.get(trajectory_uid)
        if entry is not None:
            entry.last_seen = time.time()

    def release(self, trajectory_uid: str) -> None:
        """A trajectory finished; its group finishes with its last admitted trajectory."""
        entry = self.admitted.pop(trajectory_uid, None)
        if entry is None:
            return
        if not any(e.channel == entry.channel and e.prompt_uid == entry.prompt_uid for e in self.admitted.values()):
            self.finishing[(entry.channel, entry.prompt_uid)] = time.time()

    def wake(self) -> None:
        """The signals changed (called on the event loop): held requests decide again."""
        self._changed.set()
        self._changed = asyncio.Event()

    # -- deciding --------------------------------------------------------------------
    async def admit(self, trajectory_uid: str, channel: str, prompt_uid: str, start_version: Callable[[], int | None],
                    trainer_version: Callable[[], int | None], wait: float = 0.0) -> None:
        """Admit a new trajectory, holding it up to ``wait`` seconds; 429 if it is still refused then."""
        rules = self.rules(channel)
        self.forget_abandoned()
        deadline = time.monotonic() + wait
        waited = False
        while True:
            here = self.in_flight().get(channel, set())
            new_group = prompt_uid not in here and prompt_uid not in self.elsewhere(channel)
            reason = refusal(rules, self.backlog(channel, here), new_group, start_version(), trainer_version())
            if reason is None:
                self.add(trajectory_uid, channel, prompt_uid)
                self.metrics.admissions.labels(channel, "admitted", "waited" if waited else "immediately").inc()
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.metrics.admissions.labels(channel, "refused", reason).inc()
                raise self._refused(channel, reason, rules, start_version(), trainer_version())
            waited = True
            changed = self._changed
            self.metrics.waiting.labels(channel, reason).inc()
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                self.metrics.waiting.labels(channel, reason).dec()

    def _refused(self, channel: str, reason: str, rules: AdmissionRules, start: int | None,
                 trainer: int | None) -> GatewayError:
        if reason == POLICY_TOO_STALE:
            message = (f"policy version {start} is {trainer - start} versions behind the trainer's {trainer} "
                       f"(channel {channel!r} allows {rules.max_staleness}); retry once the engines serve a newer one")
        elif reason == BACKLOG_UNKNOWN:
            message = f"the trainer's backlog on channel {channel!r} is not known yet (reading it from Kafka)"
        else:
            backlog = self.backlog(channel)
            message = (f"the trainer's backlog on channel {channel!r} is {backlog.total} groups ({backlog.ready} "
                       f"ready, {backlog.in_flight_here + backlog.in_flight_elsewhere} in flight), at its mark of "
                       f"{rules.max_backlog_groups}; new trajectories wait until the trainer catches up")
        return GatewayError(429, message, type_="rate_limit_error", code=reason, retry_after=RETRY_SECONDS)
